#!/usr/bin/env python3
"""Print, as JSON, what NVML answers for the mixed-size (heterogeneous) vGPU calls on this machine, and what
vgpumgr makes of it. Read-only: queries only, never a mode change, MIG change or reset.

Run from the repository root: `python3 scripts/nvml_mixed_check.py > mixed.json`. Needs only pynvml
(nvidia-ml-py). Without a vGPU manager every call is expected to answer NotSupported; the raw answers are kept
so a replaying test (tests/test_mixed_size.py) can reproduce them.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nvml_vgpu_check import answer  # noqa: E402 - the same read-only query helper (this directory)

from vgpumgr import nvml_mixed  # noqa: E402


def main() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        report: dict[str, object] = {"taken": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                                     "driver_version": pynvml.nvmlSystemGetDriverVersion(),
                                     "pynvml": getattr(pynvml, "__version__", None), "gpus": {}}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            bus = bus.decode() if isinstance(bus, bytes) else bus
            raw = {f"nvmlDeviceGetVgpuCapabilities({c})": answer(pynvml, "nvmlDeviceGetVgpuCapabilities", h, c)
                   for c in range(12)}
            raw["nvmlDeviceGetVgpuHeterogeneousMode"] = answer(pynvml, "nvmlDeviceGetVgpuHeterogeneousMode", h)
            raw["nvmlDeviceGetMigMode"] = answer(pynvml, "nvmlDeviceGetMigMode", h)
            for fn in ("nvmlDeviceGetVgpuTypeSupportedPlacements", "nvmlDeviceGetVgpuTypeCreatablePlacements"):
                raw[f"{fn}(1131)"] = answer(pynvml, fn, h, 1131)
            # the homogeneous (equal-size) list: v2 with mode=1 (nvidia-ml-py 12.570+; older: a TypeError kept)
            raw["nvmlDeviceGetVgpuTypeSupportedPlacements(1131, mode=1, version=2)"] = answer(
                pynvml, "nvmlDeviceGetVgpuTypeSupportedPlacements", h, 1131, 1, 2)
            raw["nvmlVgpuInstanceGetPlacementId(1)"] = answer(pynvml, "nvmlVgpuInstanceGetPlacementId", 1)
            report["gpus"][bus] = {"name": pynvml.nvmlDeviceGetName(h), "raw": raw,
                                   "vgpumgr": nvml_mixed.read(pynvml, h, [1131])}
    finally:
        pynvml.nvmlShutdown()
    json.dump(report, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
