"""Reading NVML's vGPU scheduler structs, shared by the GPU's scheduler (vgpumgr.nvidia.scheduler) and each GPU
instance's (vgpumgr.nvidia.gi_scheduler): the engines, the old structs' state, the log's entries, and whether the
bindings have a call (docs/sources.md §24)."""

from __future__ import annotations

from typing import Any

from vgpumgr.nvidia.nvml import SCHEDULER_POLICIES

ENGINES = {1: "graphics", 2: "nvenc1", 3: "nvenc0"}  # NVML_VGPU_SCHEDULER_ENGINE_TYPE_*
FUNCTION_NOT_FOUND = 13


def has(n: Any, name: str) -> bool:
    try:
        return callable(getattr(n, name))
    except AttributeError:
        return False


def v1_state(n: Any, st: Any) -> dict[str, Any]:
    arr = st.arrMode == getattr(n, "NVML_VGPU_SCHEDULER_ARR_ENABLE", 2)
    p = st.schedulerParams
    ts = p.vgpuSchedDataWithARR.timeslice if arr else p.vgpuSchedData.timeslice
    return {"policy": SCHEDULER_POLICIES.get(st.schedulerPolicy, str(st.schedulerPolicy)), "arr": arr,
            "timeslice_ns": ts or None, "avg_factor": (p.vgpuSchedDataWithARR.avgFactor or None) if arr else None}


def entries(log: Any) -> list[dict[str, int]]:
    out = []
    for k in range(min(int(log.entriesCount), len(log.logEntries))):
        e = log.logEntries[k]
        out.append({"timestamp_ns": int(e.timestamp), "run_ns": int(e.timeRun), "total_ns": int(e.timeRunTotal),
                    "runlist": int(e.swRunlistId), "target_ns": int(e.targetTimeSlice),
                    "preemption_ns": int(e.cumulativePreemptionTime)})
    return out
