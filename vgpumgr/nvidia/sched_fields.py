"""Reading NVML's vGPU scheduler structs, shared by the GPU's scheduler (vgpumgr.nvidia.scheduler) and each GPU
instance's (vgpumgr.nvidia.gi_scheduler): the engines, the old structs' state, the log's entries, and whether the
bindings have a call, and which generation of a call (`_v2` or the old one) the driver answers, remembered per
driver (docs/sources.md §24)."""

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


def driver_may_have(layer: Any, name: str) -> bool:
    """The bindings have NVML function `name` and this driver has not answered it FunctionNotFound yet."""
    return has(layer.nvml, name) and name not in layer.missing_calls


def function_not_found(layer: Any, name: str, exc: Any) -> bool:
    """`exc` says the driver lacks `name`: remembered on the layer, so that later reads ask the older call
    straight away (the telemetry polls the log 5 times a second)."""
    if getattr(exc, "value", None) != FUNCTION_NOT_FOUND:
        return False
    layer.missing_calls.add(name)
    return True


def newest(layer: Any, fn: Any, generations: list[tuple[str, str]]) -> tuple[Any, str]:
    """(fn(api), api) with the newest generation the driver answers; `generations`: (api, NVML function) newest
    first, those the bindings have (not empty). FunctionNotFound falls back to the next, and is remembered."""
    left = [g for g in generations if g[1] not in layer.missing_calls] or generations[-1:]
    for api, name in left[:-1]:
        try:
            return fn(api), api
        except layer.nvml.NVMLError as exc:
            if not function_not_found(layer, name, exc):
                raise
    return fn(left[-1][0]), left[-1][0]


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
