"""The vGPU time-slice scheduler through NVML: capabilities, state per engine, the log, and the one write
(docs/sources.md §24).

Two generations of calls: `nvmlDeviceGetVgpuSchedulerState/Log` and `nvmlDeviceSetVgpuSchedulerState` (NVML
12.x, in every nvidia-ml-py the package allows; deprecated since NVML 13.0) and their `_v2` (per engine, ARR
always on, from nvidia-ml-py 13.595.45). The `_v2` calls are used where the bindings have them and the driver
answers them; otherwise the old ones (a `_v2` the driver lacks is asked once per driver: sched_fields). What the
driver does not answer is listed under `not_supported` (a GPU without a vGPU manager answers NotSupported to all
of it: nothing here is an error then).
"""

from __future__ import annotations

from typing import Any

from vgpumgr import ids
from vgpumgr.nvidia import gi_scheduler as nvml_gi_scheduler
from vgpumgr.nvidia.nvml import _ABSENT, SCHEDULER_POLICIES, NvmlLayer, nvml_error
from vgpumgr.nvidia.sched_fields import ENGINES, driver_may_have, function_not_found
from vgpumgr.nvidia.sched_fields import entries as _entries
from vgpumgr.nvidia.sched_fields import has as _has
from vgpumgr.nvidia.sched_fields import v1_state as _v1_state

POLICY_CODES = {v: k for k, v in SCHEDULER_POLICIES.items() if k}
STATE_V2, LOG_V2 = "nvmlDeviceGetVgpuSchedulerState_v2", "nvmlDeviceGetVgpuSchedulerLog_v2"


def _call(n: Any, absent: list[str], what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except n.NVMLError as exc:
        absent.append(what if getattr(exc, "value", None) in _ABSENT else f"{what} ({exc})")
        return None


def _v2_usable(layer: NvmlLayer) -> bool:
    return driver_may_have(layer, STATE_V2) and _has(layer.nvml, "c_nvmlVgpuSchedulerStateInfo_v2_t")


def _v2_answers(layer: NvmlLayer, handle: Any) -> bool:
    """The bindings have `_v2` and the driver answers it (an older driver answers FunctionNotFound, remembered)."""
    if not _v2_usable(layer):
        return False
    n = layer.nvml
    info = n.c_nvmlVgpuSchedulerStateInfo_v2_t()
    info.engineId = 1
    try:
        n.nvmlDeviceGetVgpuSchedulerState_v2(handle, info)
    except n.NVMLError as exc:
        return not function_not_found(layer, STATE_V2, exc)
    return True


def _engines_v2(layer: NvmlLayer, handle: Any, absent: list[str]) -> dict[str, Any] | None:
    """Each engine's state through `_v2`; None where the driver lacks it (FunctionNotFound, remembered)."""
    n = layer.nvml
    engines: dict[str, Any] = {}
    for eid, name in ENGINES.items():
        info = n.c_nvmlVgpuSchedulerStateInfo_v2_t()
        info.engineId = eid
        try:
            got = n.nvmlDeviceGetVgpuSchedulerState_v2(handle, info)
        except n.NVMLError as exc:
            if function_not_found(layer, STATE_V2, exc):
                return None
            absent.append(f"state ({name})" if getattr(exc, "value", None) in _ABSENT else f"state ({name}) ({exc})")
            continue
        engines[name] = {"policy": SCHEDULER_POLICIES.get(got.schedulerPolicy, str(got.schedulerPolicy)),
                         "arr": True, "timeslice_ns": got.timeslice or None, "avg_factor": got.avgFactor or None}
    return engines


def _gpu(layer: NvmlLayer, address: str, doing: str) -> tuple[str, Any]:
    """(the checked address, NVML's handle of the GPU); NVML's errors said as `doing` ... of the address."""
    layer._require()
    address = ids.pci_address(address)
    with layer._errors(f"{doing} of {address}"):
        return address, layer._handle(address)


def read(layer: NvmlLayer, address: str) -> dict[str, Any]:
    """Capabilities, the state of each engine and which calls answered: {"address", "api", "capabilities",
    "engines": {"graphics": {...}}, "active_vgpus", "mig", "heterogeneous_mode", "gpu_instances" (with MIG on:
    each GPU instance's scheduler, vgpumgr.nvidia.gi_scheduler), "mig_note", "not_supported"}."""
    address, handle = _gpu(layer, address, "reading the vGPU scheduler")
    n = layer.nvml
    absent: list[str] = []
    caps = _call(n, absent, "capabilities", n.nvmlDeviceGetVgpuSchedulerCapabilities, handle)
    engines = _engines_v2(layer, handle, absent) if _v2_usable(layer) else None
    v2 = engines is not None
    if engines is None:
        engines = {}
        st = _call(n, absent, "state", n.nvmlDeviceGetVgpuSchedulerState, handle)
        if st is not None:
            engines["graphics"] = _v1_state(n, st)
    active = _call(n, absent, "active_vgpus", n.nvmlDeviceGetActiveVgpus, handle)
    mig = _call(n, [], "mig", n.nvmlDeviceGetMigMode, handle)
    hetero = _call(n, [], "heterogeneous_mode", n.nvmlDeviceGetVgpuHeterogeneousMode, handle)
    name = _call(n, [], "name", n.nvmlDeviceGetName, handle)
    with layer._errors(f"reading the vGPU scheduler of the GPU instances of {address}"):
        gis = nvml_gi_scheduler.read(layer, handle, None if mig is None else bool(mig[0]), caps is not None)
    return {
        "address": address, "name": name, "api": "v2" if v2 else "v1",
        "capabilities": None if caps is None else {
            "policies": [SCHEDULER_POLICIES.get(p, str(p)) for p in caps.supportedSchedulers if p],
            "timeslice_ms": [caps.minTimeslice / 1e6, caps.maxTimeslice / 1e6],
            "arr": bool(caps.isArrModeSupported),
            "frequency_hz": [caps.minFrequencyForARR, caps.maxFrequencyForARR],
            "avg_factor": [caps.minAvgFactorForARR, caps.maxAvgFactorForARR]},
        "engines": engines,
        "active_vgpus": None if active is None else len(list(active)),
        "mig": None if mig is None else bool(mig[0]),
        "heterogeneous_mode": None if hetero is None else bool(hetero),
        "gpu_instances": gis["gpu_instances"], "mig_note": gis["mig_note"],
        "not_supported": absent + gis["not_supported"],
    }


def read_log(layer: NvmlLayer, address: str, engine: int = 1) -> dict[str, Any]:
    """The driver's log of the last time slices: {"policy", "timeslice_ns", "entries": [{"timestamp_ns",
    "run_ns", "total_ns", "runlist", "target_ns", "preemption_ns"}], "not_supported"}. NVML keeps 200 entries:
    read it at least 5 times a second to see every slice (the header)."""
    address, handle = _gpu(layer, address, "reading the vGPU scheduler log")
    n = layer.nvml
    absent: list[str] = []
    log = None
    if driver_may_have(layer, LOG_V2) and _has(n, "c_nvmlVgpuSchedulerLogInfo_v2_t"):
        info = n.c_nvmlVgpuSchedulerLogInfo_v2_t()
        info.engineId = engine
        try:
            log = n.nvmlDeviceGetVgpuSchedulerLog_v2(handle, info)
        except n.NVMLError as exc:
            if not function_not_found(layer, LOG_V2, exc):
                absent.append("log" if getattr(exc, "value", None) in _ABSENT else f"log ({exc})")
                return {"address": address, "policy": None, "timeslice_ns": None, "entries": [],
                        "not_supported": absent}
        if log is not None:
            return {"address": address, "api": "v2",
                    "policy": SCHEDULER_POLICIES.get(log.schedulerPolicy, str(log.schedulerPolicy)),
                    "timeslice_ns": log.timeslice or None, "entries": _entries(log), "not_supported": absent}
    if engine != 1:
        return {"address": address, "policy": None, "timeslice_ns": None, "entries": [],
                "not_supported": [f"log of engine {engine} (needs the _v2 call)"]}
    log = _call(n, absent, "log", n.nvmlDeviceGetVgpuSchedulerLog, handle)
    if log is None:
        return {"address": address, "policy": None, "timeslice_ns": None, "entries": [], "not_supported": absent}
    st = _v1_state(n, log)
    return {"address": address, "api": "v1", "policy": st["policy"], "timeslice_ns": st["timeslice_ns"],
            "entries": _entries(log), "not_supported": absent}


def apply(layer: NvmlLayer, address: str, policy: str, *, timeslice_ms: int | None = None,
          frequency_hz: int | None = None, avg_factor: int | None = None, api: str | None = None) -> dict[str, Any]:
    """Set the scheduler through NVML (`_v2` where answered, else the old call). NVML refuses while a vGPU
    exists on the GPU or MIG is on (NotSupported: a Conflict here)."""
    layer._require()
    n = layer.nvml
    address = ids.pci_address(address)
    with layer._errors(f"setting the vGPU scheduler of {address}"):
        handle = layer._handle(address)
        # _v2 has no time slice (ARR is always on, its slice 1/frequency): a time slice takes the old call
        use_v2 = (api == "v2") if api else (not timeslice_ms and _v2_answers(layer, handle))
        if use_v2:
            st = n.c_nvmlVgpuSchedulerState_v2_t()
            st.engineId = 1
            st.schedulerPolicy = POLICY_CODES[policy]
            st.avgFactor = avg_factor or 0
            st.frequency = frequency_hz or 0
            n.nvmlDeviceSetVgpuSchedulerState_v2(handle, st)
        else:
            st = n.c_nvmlVgpuSchedulerSetState_t()
            st.schedulerPolicy = POLICY_CODES[policy]
            if frequency_hz or avg_factor:
                st.enableARRMode = getattr(n, "NVML_VGPU_SCHEDULER_ARR_ENABLE", 2)
                st.schedulerParams.vgpuSchedDataWithARR.avgFactor = avg_factor or 0
                st.schedulerParams.vgpuSchedDataWithARR.frequency = frequency_hz or 0
            elif timeslice_ms:
                st.enableARRMode = getattr(n, "NVML_VGPU_SCHEDULER_ARR_DISABLE", 1)
                st.schedulerParams.vgpuSchedData.timeslice = timeslice_ms * 1_000_000
            else:
                st.enableARRMode = getattr(n, "NVML_VGPU_SCHEDULER_ARR_DEFAULT", 0)
            n.nvmlDeviceSetVgpuSchedulerState(handle, st)
    return {"address": address, "api": "v2" if use_v2 else "v1"}


__all__ = ["ENGINES", "POLICY_CODES", "apply", "nvml_error", "read", "read_log"]
