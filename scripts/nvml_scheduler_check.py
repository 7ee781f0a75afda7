#!/usr/bin/env python3
"""Print, as JSON, what NVML answers for the vGPU scheduler calls (capabilities, state and log, the old calls and
the `_v2` ones per engine) on this machine, and what vgpumgr makes of it. Read-only: never a set, a MIG mode
change or a reset.

Run from the repository root: `python3 scripts/nvml_scheduler_check.py > scheduler.json`. Needs only pynvml
(nvidia-ml-py). On a GPU without a vGPU manager every scheduler call is expected to answer NotSupported; the raw
answers are kept so that a replaying test reproduces them (tests/fixtures/nvml/h100-scheduler.json).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nvml_vgpu_check import answer  # noqa: E402 - the same read-only query helper (this directory)

from vgpumgr import nvml_scheduler  # noqa: E402
from vgpumgr.nvidia.nvml import NvmlLayer  # noqa: E402


def main() -> int:
    layer = NvmlLayer.system()
    report: dict[str, object] = {"taken": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                                 "host": platform.node(), "python": platform.python_version()}
    with layer:
        n = layer.nvml
        report["driver"] = layer.driver()
        try:
            import importlib.metadata as md

            report["nvidia_ml_py"] = md.version("nvidia-ml-py")
        except Exception:  # noqa: BLE001 - a copied pynvml.py has no metadata
            report["nvidia_ml_py"] = getattr(n, "__version__", None)
        report["gpus"] = {}
        for address in sorted(layer.addresses() if layer.available else ()):
            h = layer._handle(address)
            raw = {fn: answer(n, fn, h) for fn in (
                "nvmlDeviceGetVgpuSchedulerCapabilities", "nvmlDeviceGetVgpuSchedulerState",
                "nvmlDeviceGetVgpuSchedulerLog", "nvmlDeviceGetActiveVgpus", "nvmlDeviceGetMigMode",
                "nvmlDeviceGetVgpuHeterogeneousMode", "nvmlDeviceGetName")}
            for engine in (1, 2, 3):
                if hasattr(n, "c_nvmlVgpuSchedulerStateInfo_v2_t"):
                    info = n.c_nvmlVgpuSchedulerStateInfo_v2_t()
                    info.engineId = engine
                    raw[f"nvmlDeviceGetVgpuSchedulerState_v2/{engine}"] = answer(
                        n, "nvmlDeviceGetVgpuSchedulerState_v2", h, info)
                if hasattr(n, "c_nvmlVgpuSchedulerLogInfo_v2_t"):
                    log = n.c_nvmlVgpuSchedulerLogInfo_v2_t()
                    log.engineId = engine
                    raw[f"nvmlDeviceGetVgpuSchedulerLog_v2/{engine}"] = answer(
                        n, "nvmlDeviceGetVgpuSchedulerLog_v2", h, log)
            report["gpus"][address] = {"raw": raw, "vgpumgr_read": nvml_scheduler.read(layer, address),
                                       "vgpumgr_log": nvml_scheduler.read_log(layer, address)}
    json.dump(report, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
