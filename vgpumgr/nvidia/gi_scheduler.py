"""The vGPU scheduler of each MIG GPU instance, read only (docs/sources.md §24).

With MIG on, NVML answers the per-GPU scheduler calls NotSupported (since R575); a GPU whose GPU instances
time-slice vGPUs (NVIDIA's header: "For Blackwell GB20x or newer") has a scheduler per GPU instance instead:
`nvmlGpuInstanceGetVgpuSchedulerState/Log` (nvidia-ml-py 12.575.51 and later; versioned structs) and their
`_v2` (13.595.45 and later; per engine, ARR always on). `_v2` is asked first where the bindings have it, the
old call where the driver lacks `_v2` (FunctionNotFound). Before GB20x, MIG-backed vGPUs get fixed share and
the GPU instances have no scheduler of their own: the driver answers NotSupported, said under `not_supported`
and in `mig_note`. Bindings without either call are said so too; nothing is guessed.
"""

from __future__ import annotations

from typing import Any

from vgpumgr import ids
from vgpumgr.errors import Conflict, NotFound
from vgpumgr.nvidia.nvml import _ABSENT, SCHEDULER_POLICIES, NvmlLayer, _profile_name
from vgpumgr.nvidia.sched_fields import ENGINES, newest
from vgpumgr.nvidia.sched_fields import entries as _entries
from vgpumgr.nvidia.sched_fields import has as _has
from vgpumgr.nvidia.sched_fields import v1_state as _v1_state

_NOT_SUPPORTED = 3
BLACKWELL = 10  # NVML_DEVICE_ARCH_BLACKWELL; every GPU before it is before GB20x
V2, V1 = "nvmlGpuInstanceGetVgpuSchedulerState_v2", "nvmlGpuInstanceGetVgpuSchedulerState"
LOG_V2, LOG_V1 = "nvmlGpuInstanceGetVgpuSchedulerLog_v2", "nvmlGpuInstanceGetVgpuSchedulerLog"
NO_BINDINGS = ("gpu_instance_scheduler (these nvidia-ml-py bindings have no nvmlGpuInstanceGetVgpuSchedulerState: "
               "12.575.51 brought it, 13.595.45 its _v2)")
NO_LOG_BINDINGS = ("log (these nvidia-ml-py bindings have no nvmlGpuInstanceGetVgpuSchedulerLog: 12.575.51 brought "
                   "it, 13.595.45 its _v2)")
FIXED_SHARE = ("MIG-backed vGPUs get fixed share on this GPU: before GB20x NVIDIA's driver allows no other policy "
               "with MIG on, and its GPU instances have no scheduler of their own")


def apis(n: Any) -> list[str]:
    """The per-GPU-instance generations these bindings have, newest first."""
    out = []
    if _has(n, V2) and _has(n, "c_nvmlVgpuSchedulerStateInfo_v2_t"):
        out.append("v2")
    if _has(n, V1) and _has(n, "c_nvmlVgpuSchedulerStateInfo_v1_t"):
        out.append("v1")
    return out


def instances(layer: NvmlLayer, handle: Any) -> list[tuple[dict[str, Any], Any]]:
    """({"id", "profile", "start", "size"}, GPU instance handle) of every GPU instance, by start."""
    profiles = layer._profiles(handle)
    names = {info.id: _profile_name(enum, info) for enum, info in profiles}
    out = []
    for gi in layer._gpu_instance_handles(handle, profiles):
        info = layer.nvml.nvmlGpuInstanceGetInfo(gi)
        out.append(({"id": info.id, "profile": names.get(info.profileId), "start": info.placement.start,
                     "size": info.placement.size}, gi))
    return sorted(out, key=lambda x: (x[0]["start"], x[0]["id"]))


def _state(n: Any, gi: Any, engine: int, api: str) -> dict[str, Any]:
    if api == "v2":
        info = n.c_nvmlVgpuSchedulerStateInfo_v2_t()
        info.engineId = engine
        got = n.nvmlGpuInstanceGetVgpuSchedulerState_v2(gi, info)
        return {"policy": SCHEDULER_POLICIES.get(got.schedulerPolicy, str(got.schedulerPolicy)), "arr": True,
                "timeslice_ns": got.timeslice or None, "avg_factor": got.avgFactor or None}
    info = n.c_nvmlVgpuSchedulerStateInfo_v1_t()
    info.version = n.nvmlVgpuSchedulerStateInfo_v1
    info.engineId = engine
    return _v1_state(n, n.nvmlGpuInstanceGetVgpuSchedulerState(gi, info))


def _generations(available: list[str], v2: str, v1: str) -> list[tuple[str, str]]:
    return [(api, v2 if api == "v2" else v1) for api in available]


def read(layer: NvmlLayer, handle: Any, mig_on: bool | None, vgpu_host: bool = True) -> dict[str, Any]:
    """{"gpu_instances": [{"id", "profile", "start", "size", "api", "engines"}] (None while MIG is off),
    "not_supported": [...], "mig_note": str | None}. `vgpu_host`: the GPU has a vGPU manager (its scheduler
    capabilities answer); without one, NotSupported says nothing about GB20x and no note is given."""
    if not mig_on:
        return {"gpu_instances": None, "not_supported": [], "mig_note": None}
    n = layer.nvml
    arch = None
    if _has(n, "nvmlDeviceGetArchitecture"):
        try:
            arch = n.nvmlDeviceGetArchitecture(handle)
        except n.NVMLError:
            pass
    before_gb20x = isinstance(arch, int) and 0 < arch < BLACKWELL
    available = apis(n)
    found = instances(layer, handle)
    absent: list[str] = [] if available else [NO_BINDINGS]
    refused: list[int] = []
    out = []
    for gi_json, gi in found:
        engines: dict[str, Any] = {}
        used = None
        for engine, name in ENGINES.items() if available else ():
            try:
                engines[name], used = newest(layer, lambda api, gi=gi, e=engine: _state(n, gi, e, api),
                                             _generations(available, V2, V1))
            except n.NVMLError as exc:
                code = getattr(exc, "value", None)
                if engine == 1 and code == _NOT_SUPPORTED:
                    refused.append(gi_json["id"])
                else:
                    absent.append(f"GPU instance {gi_json['id']} state ({name})"
                                  + ("" if code in _ABSENT else f" ({exc})"))
                if engine == 1:
                    break
        out.append({**gi_json, "api": used, "engines": engines})
    if refused:
        absent.append(f"GPU instance state (GPU instance {', '.join(map(str, refused))}: NotSupported; NVIDIA "
                      "documents a scheduler per GPU instance for Blackwell GB20x or newer)")
    note = FIXED_SHARE if vgpu_host and (before_gb20x or (refused and len(refused) == len(found))) else None
    return {"gpu_instances": out, "not_supported": absent, "mig_note": note}


def read_log(layer: NvmlLayer, address: str, gpu_instance: int, engine: int = 1) -> dict[str, Any]:
    """One GPU instance's scheduler log, as `nvml_scheduler.read_log` gives a GPU's, plus "gpu_instance"."""
    layer._require()
    n = layer.nvml
    address = ids.pci_address(address)
    with layer._errors(f"reading the vGPU scheduler log of GPU instance {gpu_instance} on {address}"):
        handle = layer._handle(address)
        try:
            mig_on = bool(n.nvmlDeviceGetMigMode(handle)[0])
        except n.NVMLError as exc:
            if getattr(exc, "value", None) not in _ABSENT:
                raise
            mig_on = False  # a GPU without MIG
        if not mig_on:
            raise Conflict(f"MIG is off on {address}: it has no GPU instances",
                           hint=f"`vgpumgr scheduler log {address}` reads the GPU's own log")
        gi = next((g for info, g in instances(layer, handle) if info["id"] == gpu_instance), None)
    if gi is None:
        raise NotFound(f"GPU {address} has no GPU instance {gpu_instance}", hint=f"`vgpumgr mig list {address}`")
    out: dict[str, Any] = {"address": address, "gpu_instance": gpu_instance, "api": None, "policy": None,
                           "timeslice_ns": None, "entries": [], "not_supported": []}
    available = [a for a in apis(n) if _has(n, LOG_V2 if a == "v2" else LOG_V1)]
    if not available:
        out["not_supported"] = [NO_LOG_BINDINGS]
        return out

    def ask(api: str) -> Any:
        if api == "v2":
            info = n.c_nvmlVgpuSchedulerLogInfo_v2_t()
            info.engineId = engine
            return n.nvmlGpuInstanceGetVgpuSchedulerLog_v2(gi, info)
        info = n.c_nvmlVgpuSchedulerLogInfo_v1_t()
        info.version = n.nvmlVgpuSchedulerLogInfo_v1
        info.engineId = engine
        return n.nvmlGpuInstanceGetVgpuSchedulerLog(gi, info)

    try:
        log, api = newest(layer, ask, _generations(available, LOG_V2, LOG_V1))
    except n.NVMLError as exc:
        code = getattr(exc, "value", None)
        out["not_supported"] = [("log (NotSupported: NVIDIA documents a scheduler per GPU instance for Blackwell "
                                 "GB20x or newer)") if code == _NOT_SUPPORTED else
                                "log" if code in _ABSENT else f"log ({exc})"]
        return out
    st = _v1_state(n, log) if api == "v1" else {
        "policy": SCHEDULER_POLICIES.get(log.schedulerPolicy, str(log.schedulerPolicy)),
        "timeslice_ns": log.timeslice or None}
    out.update(api=api, policy=st["policy"], timeslice_ns=st["timeslice_ns"], entries=_entries(log))
    return out
