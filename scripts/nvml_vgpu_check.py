#!/usr/bin/env python3
"""Print, as JSON, what NVML answers for the vGPU-instance, telemetry and migration calls on this machine, and
what vgpumgr makes of it. Read-only: only queries, never a MIG mode change, reset or any other write.

Run from the repository root: `python3 scripts/nvml_vgpu_check.py > vgpu.json`. Needs only pynvml
(nvidia-ml-py); vgpumgr is taken from this checkout. On a GPU in passthrough mode (no vGPU manager) every
vGPU call is expected to answer NotSupported; the raw answers are kept so a replaying test can reproduce them.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vgpumgr import compat  # noqa: E402
from vgpumgr.nvidia import migration as nvmig  # noqa: E402
from vgpumgr.nvidia.nvml import NvmlLayer  # noqa: E402


def answer(nvml, fn: str, *args: object) -> dict[str, object]:  # noqa: ANN001 - a pynvml module
    """The call's value (as far as JSON can hold it) or its NVML error code."""
    try:
        value = getattr(nvml, fn)(*args)
    except nvml.NVMLError as exc:
        return {"error": exc.value, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a missing symbol in an older pynvml, say
        return {"exception": type(exc).__name__, "message": str(exc)}
    if isinstance(value, (list, tuple)):
        return {"value": [v if isinstance(v, (int, str, float)) else repr(v) for v in value]}
    if hasattr(value, "placementIds"):  # nvmlVgpuPlacementList_t (scripts/nvml_mixed_check.py)
        return {"value": {"placementSize": value.placementSize,
                          "ids": [value.placementIds[i] for i in range(value.count)]}}
    if isinstance(value, (int, str, float, bool)) or value is None:
        return {"value": value}
    return {"value": repr(value)[:300]}


def main() -> int:
    layer = NvmlLayer.system()
    report: dict[str, object] = {"taken": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                                 "host": platform.node(), "python": platform.python_version()}
    with layer:
        report["driver"] = layer.driver()
        n = layer.nvml
        gpus = layer.gpus()
        report["gpus"] = {}
        report["system"] = {"nvmlGetVgpuVersion": answer(n, "nvmlGetVgpuVersion")} if n else {}
        for address, g in gpus.items():
            h = layer._handle(address)
            raw = {fn: answer(n, fn, h) for fn in (
                "nvmlDeviceGetVirtualizationMode", "nvmlDeviceGetHostVgpuMode", "nvmlDeviceGetActiveVgpus",
                "nvmlDeviceGetSupportedVgpus", "nvmlDeviceGetCreatableVgpus", "nvmlDeviceGetVgpuMetadata")}
            now_us = int(time.time() * 1e6) - 5_000_000
            for fn in ("nvmlDeviceGetVgpuUtilization", "nvmlDeviceGetVgpuInstancesUtilizationInfo",
                       "nvmlDeviceGetVgpuProcessesUtilizationInfo"):
                raw[fn] = answer(n, fn, h, now_us)
            device_id = str(g.get("pci_id") or "").split(":")[-1] or None
            cand = nvmig.candidate(layer, address, device_id, g.get("name"))
            vgpu = compat.MigratingVgpu("NVIDIA H100XM-1-10C", device_id=device_id, gpu_name=g.get("name"),
                                        host_driver=cand.host_driver)
            report["gpus"][address] = {
                "name": g.get("name"), "raw": raw,
                "source_facts": nvmig.source_facts(layer, address, vm_uuid="00000000-0000-0000-0000-000000000000",
                                                   type_id=1131),
                "verdict_without_metadata": nvmig.verdict(layer, cand, vgpu, "NVIDIA H100XM-1-10C", None).as_dict(),
                "verdict_with_foreign_metadata": nvmig.verdict(layer, cand, vgpu, "NVIDIA H100XM-1-10C",
                                                               "AAAA").as_dict(),
            }
        from vgpumgr.telemetry.read import Reader

        gpus_read, notices = Reader(layer).read()  # what `vgpumgr top` and /metrics would show
        report["telemetry_reader"] = {"notices": notices,
                                      "gpus": [{"gpu": g.address, "vgpus": len(g.vgpus), "absent": g.absent}
                                               for g in gpus_read]}
    json.dump(report, sys.stdout, indent=1, sort_keys=True, default=str)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
