"""The simulated driver's vGPU placements (docs/sources.md §21).

State per physical GPU in the simulator's state file: `heterogeneous` (mixed-size mode), `arch`, `driver_branch`
and `placements` = {VF address or mdev UUID: [type id, placement id]}. What the driver does:
- R570+: a vGPU gets the first creatable placement ID when it is created (mdev made / current_vgpu_type
  written), in mixed-size mode and, on Ada and newer, in equal-size mode (homogeneous IDs: `j * size`; while a
  vGPU exists only its placement size has creatable IDs); `nvidia/placement_id` reads it and a write moves it to
  another creatable ID; removal frees it.
- R550: no `placement_id` file; `vgpu-placement-id=<id>` in `nvidia/vgpu_params` names it. The driver takes the
  placement when the vGPU is registered; the simulator registers at creation (a VF's params are written before
  its type) and applies a later params write at once where the ID is creatable.
- The mode and every placement are lost with the vGPUs: reboot, driver reload, VFs disabled or enabled.
"""

from __future__ import annotations

import errno
from typing import Any

from vgpumgr.placement import ids as pid

NOT_APPLICABLE = "Not Applicable\n"


def branch(gpu: dict[str, Any]) -> int:
    return int(gpu.get("driver_branch", 580))


def region(gpu: dict[str, Any]) -> int:
    return int(gpu["total_fb_mb"]) // 1024


def capable(gpu: dict[str, Any], numvfs: int) -> bool:
    """HETEROGENEOUS_TIMESLICE_SIZES: only with SR-IOV VFs enabled, on a GPU generation that has it, MIG off."""
    return bool(gpu.get("arch")) and numvfs > 0 and not gpu.get("mig")


def homogeneous_ids(gpu: dict[str, Any]) -> bool:
    """Placement IDs in equal-size mode: Ada and newer, from R570."""
    return gpu.get("arch") in (pid.ADA, pid.HOPPER, pid.BLACKWELL) and branch(gpu) >= 570


def slots(gpu: dict[str, Any], t: dict[str, Any], mixed: bool | None = None) -> tuple[int, tuple[int, ...]]:
    """(placement size, supported IDs) of one catalog type in the GPU's mode (or the one named)."""
    mixed = gpu.get("heterogeneous", False) if mixed is None else mixed
    size_gb = max(t["framebuffer_mb"] // 1024, 1)
    r = region(gpu)
    arch = gpu.get("arch") or pid.ADA
    if mixed:
        return pid.placement_size(r, size_gb, arch), pid.supported(r, size_gb, t["max_instance"], arch)
    return pid.homogeneous_slots(r, size_gb, t["max_instance"], arch)


def occupied(gpu: dict[str, Any]) -> list[tuple[int, int]]:
    by_id = {t["id"]: t for t in gpu["catalog"]}
    out = []
    for type_id, place in gpu.get("placements", {}).values():
        t = by_id.get(type_id)
        if t is not None and place is not None:
            out.append((place, slots(gpu, t)[0]))
    return out


def creatable_ids(gpu: dict[str, Any], t: dict[str, Any], mixed: bool | None = None) -> list[int]:
    """Mixed size: the IDs whose range is free. Equal size (homogeneous IDs): the free IDs of types of the first
    vGPU's placement size; every other size has none while a vGPU exists (the driver invalidates them)."""
    mixed = gpu.get("heterogeneous", False) if mixed is None else mixed
    size, ids = slots(gpu, t, mixed)
    return pid.creatable_in_mode(region(gpu), ids, size, occupied(gpu), equal=not mixed)


def tracked(gpu: dict[str, Any]) -> bool:
    """Does this GPU's driver hand out placement IDs now?"""
    return bool(gpu.get("arch")) and (gpu.get("heterogeneous", False) or homogeneous_ids(gpu))


def reserve(gpu: dict[str, Any], key: str, type_id: int, wanted: int | None = None) -> int | None:
    """Take the wanted (else the first creatable) placement for a new vGPU; None where IDs do not apply."""
    if not tracked(gpu):
        return None
    t = next(t for t in gpu["catalog"] if t["id"] == type_id)
    free = creatable_ids(gpu, t)
    if not free:
        if not gpu.get("heterogeneous"):  # equal size: the size rule already decided; IDs are only reported
            return None
        raise OSError(errno.EINVAL, "no creatable placement")
    place = wanted if wanted in free else free[0]
    gpu.setdefault("placements", {})[key] = [type_id, place]
    return place


def move(gpu: dict[str, Any], key: str, wanted: int) -> int:
    """A write of `placement_id`: the same ID is a no-op; another must be creatable for the type."""
    held = gpu.get("placements", {}).get(key)
    if held is None or not tracked(gpu):
        raise OSError(errno.EINVAL, "placement IDs do not apply")
    type_id, place = held
    if wanted == place:
        return place
    t = next(t for t in gpu["catalog"] if t["id"] == type_id)
    del gpu["placements"][key]
    if wanted not in creatable_ids(gpu, t):
        gpu["placements"][key] = held
        raise OSError(errno.EINVAL, "placement not creatable")
    gpu["placements"][key] = [type_id, wanted]
    return wanted


def release(gpu: dict[str, Any], key: str) -> None:
    gpu.get("placements", {}).pop(key, None)


def placement_of(gpu: dict[str, Any], key: str) -> int | None:
    held = gpu.get("placements", {}).get(key)
    return None if held is None else held[1]


def file_text(gpu: dict[str, Any], key: str) -> str:
    place = placement_of(gpu, key)
    return NOT_APPLICABLE if place is None else f"{place}\n"


def params_placement(text: str) -> int | None:
    """`vgpu-placement-id=<id>` of a vgpu_params text (comma-separated name=value)."""
    for item in text.replace("\n", ",").split(","):
        name, _, value = item.strip().partition("=")
        if name.strip() == "vgpu-placement-id" and value.strip().isdigit():
            return int(value.strip())
    return None


def lose_mode(gpu: dict[str, Any]) -> bool:
    """What a reboot, driver reload or sriov-manage does: the mode and the placements go. True if it was on."""
    was = bool(gpu.get("heterogeneous"))
    gpu["heterogeneous"] = False
    gpu["placements"] = {}
    return was
