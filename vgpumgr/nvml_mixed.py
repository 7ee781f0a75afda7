"""NVML's mixed-size ("heterogeneous") vGPU facts and the mode switch, across nvidia-ml-py versions.

The calls arrived in nvidia-ml-py 12.550 (mode, placements v1, instance placement ID) and 12.570 (the v2
placement list with its `mode` argument); capabilities are asked with `nvmlDeviceGetVgpuCapabilities`.
Mind the polarity: the mode struct says 1 = heterogeneous (mixed size), the placement list's `mode` says
0 = heterogeneous, 1 = homogeneous. Whatever NVML cannot answer is None ("unknown"), never a guess.
(docs/sources.md §21)
"""

from __future__ import annotations

from typing import Any

CAP_HETEROGENEOUS_SIZES = 2  # NVML_DEVICE_VGPU_CAP_HETEROGENEOUS_TIMESLICE_SIZES
MODE_ENABLED = 1  # NVML_FEATURE_ENABLED in nvmlVgpuHeterogeneousMode_t: mixed size
PLACEMENT_LIST_HETEROGENEOUS = 0  # NVML_VGPU_PGPU_HETEROGENEOUS_MODE (placement-list `mode`)
INVALID_PLACEMENT = 0xFFFF
MIXED, EQUAL = "mixed", "equal"


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


def read(n: Any, handle: Any, type_ids: list[int]) -> dict[str, Any]:
    """{"capable", "mode", "types": {type id: {"placement_size", "supported", "creatable"}}, "running": [...]}:
    None where NVML does not say. Per-type placements and the running vGPUs' placement IDs (the only place R550
    shows them) are read only on a GPU in mixed-size mode."""
    cap = _call(n, "nvmlDeviceGetVgpuCapabilities", handle, CAP_HETEROGENEOUS_SIZES)
    raw = _call(n, "nvmlDeviceGetVgpuHeterogeneousMode", handle)
    mode = None if raw is None else (MIXED if int(raw) == MODE_ENABLED else EQUAL)
    out: dict[str, Any] = {"capable": None if cap is None else bool(cap), "mode": mode, "types": {}}
    if not cap or mode != MIXED:  # placements matter (and are read) in mixed-size mode only
        return out
    for tid in type_ids:
        sup = _placements(n, "nvmlDeviceGetVgpuTypeSupportedPlacements", handle, tid,
                          mode=PLACEMENT_LIST_HETEROGENEOUS, version=2)
        cre = _placements(n, "nvmlDeviceGetVgpuTypeCreatablePlacements", handle, tid)
        if sup is None and cre is None:
            continue
        size = getattr(sup if sup is not None else cre, "placementSize", None)
        out["types"][str(tid)] = {"placement_size": size, "supported": _ids(sup), "creatable": _ids(cre)}
    out["running"] = [{"mdev_uuid": _call(n, "nvmlVgpuInstanceGetMdevUUID", i) or None,
                       "type_id": _call(n, "nvmlVgpuInstanceGetType", i), "placement_id": instance_placement(n, i)}
                      for i in _call(n, "nvmlDeviceGetActiveVgpus", handle) or []]
    return out


def instance_placement(n: Any, instance: Any) -> int | None:
    """A running vGPU's placement ID; None outside mixed-size mode or where NVML cannot tell."""
    got = _call(n, "nvmlVgpuInstanceGetPlacementId", instance)
    return None if got is None or int(got) == INVALID_PLACEMENT else int(got)


def set_mode(n: Any, handle: Any, mixed: bool) -> None:
    """nvmlDeviceSetVgpuHeterogeneousMode; raises the library's NVMLError (IN_USE while a vGPU exists)."""
    fn = getattr(n, "nvmlDeviceSetVgpuHeterogeneousMode", None)
    if fn is None:
        raise n.NVMLError(13)  # FUNCTION_NOT_FOUND: nvidia-ml-py older than 12.550
    fn(handle, MODE_ENABLED if mixed else 0)
