#!/usr/bin/env python3
"""Print what vgpumgr's NVML layer reads on this machine, as JSON (read-only NVML calls only).

Run from the repository root: `python3 scripts/nvml_check.py > nvml.json`. Needs only pynvml
(nvidia-ml-py); vgpumgr is taken from this checkout. Also records every raw GPU-instance profile
answer per enum index, so a replaying fake can reproduce NotSupported vs InvalidArgument exactly.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vgpumgr.nvidia.nvml import NvmlLayer  # noqa: E402


def raw_profile_answers(nvml) -> dict[str, dict[str, object]]:  # noqa: ANN001 - a pynvml module
    """Per GPU, per NVML_GPU_INSTANCE_PROFILE_* index: the profile id or the NVML error code."""
    out: dict[str, dict[str, object]] = {}
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        answers: dict[str, object] = {}
        for enum in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                answers[str(enum)] = {"id": nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum).id}
            except nvml.NVMLError as exc:
                answers[str(enum)] = {"error": exc.value, "message": str(exc)}
        out[str(index)] = answers
    return out


def main() -> int:
    layer = NvmlLayer.system()
    with layer:
        report: dict[str, object] = {
            "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
            "host": {"kernel": platform.release(), "python": platform.python_version()},
            "driver": layer.driver(),
            "gpus": layer.gpus(),
            "notice": layer.notice,
        }
        if layer.nvml is not None:
            report["pynvml_version"] = getattr(layer.nvml, "__version__", None)
            report["raw_profile_answers"] = raw_profile_answers(layer.nvml)
    json.dump(report, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
