"""NVML's mixed-size ("heterogeneous") vGPU facts and the mode switch, across nvidia-ml-py versions.

The calls arrived in nvidia-ml-py 12.550 (mode, placements v1, instance placement ID) and 12.570 (the v2
placement list with its `mode` argument); capabilities are asked with `nvmlDeviceGetVgpuCapabilities`.
Mind the polarity: the mode struct says 1 = heterogeneous (mixed size), the placement list's `mode` says
0 = heterogeneous, 1 = homogeneous. In equal-size mode, Ada and newer GPUs with R570+ (capability
HOMOGENEOUS_PLACEMENTS) have placement IDs too: the homogeneous list, asked for only through the v2 list (the v1
list is always the heterogeneous one, so it is never taken for them). Whatever NVML cannot answer is None
("unknown"), never a guess. (docs/sources.md §21)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CAP_HETEROGENEOUS_SIZES = 2  # NVML_DEVICE_VGPU_CAP_HETEROGENEOUS_TIMESLICE_SIZES
CAP_HOMOGENEOUS_PLACEMENTS = 9  # NVML_DEVICE_VGPU_CAP_HOMOGENEOUS_PLACEMENTS (R570+)
MODE_ENABLED = 1  # NVML_FEATURE_ENABLED in nvmlVgpuHeterogeneousMode_t: mixed size
PLACEMENT_LIST_HETEROGENEOUS = 0  # NVML_VGPU_PGPU_HETEROGENEOUS_MODE (placement-list `mode`)
PLACEMENT_LIST_HOMOGENEOUS = 1  # NVML_VGPU_PGPU_HOMOGENEOUS_MODE (placement-list `mode`)
PLACEMENT_LIST_V2 = 2
INVALID_PLACEMENT = 0xFFFF
MIXED, EQUAL = "mixed", "equal"
HETEROGENEOUS, HOMOGENEOUS = "heterogeneous", "homogeneous"  # which placement lists `types` holds


def facts_of(nvml: Any) -> Mapping[str, Any]:
    """One GPU's mixed-size facts as `read` gave them, from its NVML facts (an inventory GPU's `nvml`, or an entry
    of NvmlLayer.gpus()): {} where NVML gave none or they cannot be read. Every reader of the facts starts here."""
    vgpu = nvml.get("vgpu") if isinstance(nvml, Mapping) else None
    facts = vgpu.get("mixed_size") if isinstance(vgpu, Mapping) else None
    return facts if isinstance(facts, Mapping) else {}


def mode_of(nvml: Any) -> str | None:
    """"mixed", "equal", or None (NVML cannot tell) for one GPU's NVML facts."""
    mode = facts_of(nvml).get("mode")
    return mode if mode in (MIXED, EQUAL) else None


def _call(n: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """The call's value, None when this nvidia-ml-py lacks it or the driver does not answer it."""
    fn = getattr(n, name, None)
    if fn is None:
        return None
    try:
        return fn(*args, **kwargs)
    except n.NVMLError as exc:
        if getattr(exc, "value", None) == 15:  # GPU is lost: the caller's business
            raise
        return None
    except TypeError:  # an older signature (12.550/12.560: no mode/version arguments)
        return None


def _ids(lst: Any) -> list[int] | None:
    if lst is None:
        return None
    try:
        return [int(lst.placementIds[i]) for i in range(int(lst.count))]
    except (AttributeError, TypeError, ValueError):
        return None


def _placements(n: Any, name: str, handle: Any, type_id: int, **kwargs: Any) -> Any:
    found = _call(n, name, handle, type_id, **kwargs) if kwargs else None
    return found if found is not None else _call(n, name, handle, type_id)  # 12.550-12.560: v1 only


def _homogeneous_list(n: Any, handle: Any, type_id: int) -> Any:
    """The v2 supported list with mode=homogeneous; None with an nvidia-ml-py before 12.570 (no v2: its v1 list
    would be the heterogeneous one), where the driver does not answer, or where the answer is for another mode."""
    got = _call(n, "nvmlDeviceGetVgpuTypeSupportedPlacements", handle, type_id,
                mode=PLACEMENT_LIST_HOMOGENEOUS, version=PLACEMENT_LIST_V2)
    if got is None or getattr(got, "mode", PLACEMENT_LIST_HOMOGENEOUS) != PLACEMENT_LIST_HOMOGENEOUS:
        return None
    return got


def _types(n: Any, handle: Any, type_ids: list[int], homogeneous: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tid in type_ids:
        if homogeneous:
            sup = _homogeneous_list(n, handle, tid)
        else:
            sup = _placements(n, "nvmlDeviceGetVgpuTypeSupportedPlacements", handle, tid,
                              mode=PLACEMENT_LIST_HETEROGENEOUS, version=PLACEMENT_LIST_V2)
        cre = _placements(n, "nvmlDeviceGetVgpuTypeCreatablePlacements", handle, tid)  # the GPU's current mode
        if sup is None and cre is None:
            continue
        size = getattr(sup if sup is not None else cre, "placementSize", None)
        out[str(tid)] = {"placement_size": size, "supported": _ids(sup), "creatable": _ids(cre)}
    return out


def read(n: Any, handle: Any, type_ids: list[int]) -> dict[str, Any]:
    """{"capable", "mode", "homogeneous_capable", "placements", "types": {type id: {"placement_size",
    "supported", "creatable"}}, "running": [...]}: None where NVML does not say. `placements` names the lists
    `types` holds: "heterogeneous" on a GPU in mixed-size mode, "homogeneous" on one in equal-size mode that has
    HOMOGENEOUS_PLACEMENTS (Ada and newer, R570+), else None (no per-type placements). The running vGPUs'
    placement IDs (the only place R550 shows them) are read in either mode, once the mode is known."""
    cap = _call(n, "nvmlDeviceGetVgpuCapabilities", handle, CAP_HETEROGENEOUS_SIZES)
    raw = _call(n, "nvmlDeviceGetVgpuHeterogeneousMode", handle)
    mode = None if raw is None else (MIXED if int(raw) == MODE_ENABLED else EQUAL)
    homo = _call(n, "nvmlDeviceGetVgpuCapabilities", handle, CAP_HOMOGENEOUS_PLACEMENTS)
    out: dict[str, Any] = {"capable": None if cap is None else bool(cap), "mode": mode, "types": {},
                           "homogeneous_capable": None if homo is None else bool(homo), "placements": None}
    if mode is None:
        return out
    if cap and mode == MIXED:
        out["placements"], out["types"] = HETEROGENEOUS, _types(n, handle, type_ids, homogeneous=False)
    elif homo and mode == EQUAL:
        out["placements"], out["types"] = HOMOGENEOUS, _types(n, handle, type_ids, homogeneous=True)
    out["running"] = [{"mdev_uuid": _call(n, "nvmlVgpuInstanceGetMdevUUID", i) or None,
                       "type_id": _call(n, "nvmlVgpuInstanceGetType", i), "placement_id": instance_placement(n, i)}
                      for i in _call(n, "nvmlDeviceGetActiveVgpus", handle) or []]
    return out


def instance_placement(n: Any, instance: Any) -> int | None:
    """A running vGPU's placement ID; None where NVML gives none (NVML_INVALID_VGPU_PLACEMENT_ID: documented
    outside mixed-size mode) or cannot tell."""
    got = _call(n, "nvmlVgpuInstanceGetPlacementId", instance)
    return None if got is None or int(got) == INVALID_PLACEMENT else int(got)


def set_mode(n: Any, handle: Any, mixed: bool) -> None:
    """nvmlDeviceSetVgpuHeterogeneousMode; raises the library's NVMLError (IN_USE while a vGPU exists)."""
    fn = getattr(n, "nvmlDeviceSetVgpuHeterogeneousMode", None)
    if fn is None:
        raise n.NVMLError(13)  # FUNCTION_NOT_FOUND: nvidia-ml-py older than 12.550
    fn(handle, MODE_ENABLED if mixed else 0)
