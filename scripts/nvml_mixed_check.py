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

from vgpumgr import nvml_mixed  # noqa: E402


def answer(nvml, fn: str, *args: object) -> dict[str, object]:  # noqa: ANN001 - a pynvml module
    try:
        value = getattr(nvml, fn)(*args)
    except nvml.NVMLError as exc:
        return {"error": exc.value, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a missing symbol in an older pynvml, say
        return {"exception": type(exc).__name__, "message": str(exc)}
    if hasattr(value, "placementIds"):
        return {"value": {"placementSize": value.placementSize,
                          "ids": [value.placementIds[i] for i in range(value.count)]}}
    return {"value": value if isinstance(value, (int, str, float, bool)) or value is None else repr(value)[:200]}


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
