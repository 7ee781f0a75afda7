"""Placement on a GPU in NVIDIA's mixed-size mode: which placement ID, what it costs, and why none fits.

Called by vgpumgr.placement.placer for a (GPU, type) candidate on a GPU in mixed-size mode. The type's supported IDs
come from NVML when discovery read them, else from the driver's algorithm (vgpumgr.placement.ids). Existing
vGPUs sit at their known placement IDs (sysfs `placement_id`, NVML, or vgpumgr's record); one whose ID is not
known is assumed where the driver would have put it (its first free ID). The default choice is the creatable
ID that costs the GPU's other types least (`placement_ids.choose`); `Policy.placement_id` pins one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vgpumgr.nvidia import mixed as nvml_mixed
from vgpumgr.placement import ids as pid

_AMPERE_GPUS = ("A40", "A10", "A16", "A2", "A30", "A100", "A100X", "A100D", "A100DX", "A800", "RTXA6000",
                "RTXA5500", "RTXA5000")


def _arch(name: str) -> str:
    from vgpumgr import ids

    parsed = ids.parse_type_name(name)
    return pid.AMPERE if parsed and parsed.gpu in _AMPERE_GPUS else pid.ADA


def _nvml_types(px: Any, phys: str, homogeneous: bool = False) -> Mapping[str, Any]:
    """Discovery's per-type placement lists, if they are of the kind asked for (facts from before `placements`
    was recorded held heterogeneous lists only)."""
    gpu = px.gpus.get(phys)
    facts = nvml_mixed.facts_of(gpu.nvml if gpu else None)
    types = facts.get("types")
    if not isinstance(types, Mapping):
        return {}
    kind = facts.get("placements", "heterogeneous" if types else None)
    return types if kind == ("homogeneous" if homogeneous else "heterogeneous") else {}


def _slots(px: Any, phys: str, info: Any, region: int, homogeneous: bool = False) -> tuple[int, tuple[int, ...]]:
    """(placement size, supported IDs) of a type: NVML's lists where discovery read them, else the driver's rule
    (mixed size: the partition algorithm; equal size on Ada+ with R570+: `j * size`)."""
    size_gb = max((info.framebuffer_mb or 0) // 1024, 1)
    known = _nvml_types(px, phys, homogeneous).get(info.type[7:] if info.type.startswith("nvidia-") else info.type)
    if isinstance(known, Mapping) and known.get("supported") and known.get("placement_size"):
        return int(known["placement_size"]), tuple(int(p) for p in known["supported"])
    arch = _arch(info.name)
    maxi = info.max_instance or pid.equal_max(region, size_gb)
    if homogeneous:
        return pid.homogeneous_slots(region, size_gb, maxi, arch)
    return pid.placement_size(region, size_gb, arch), pid.supported(region, size_gb, maxi, arch)


@dataclass(frozen=True)
class _AllocInfo:
    """What a vGPU's record tells of its type when the GPU's catalogue does not name it."""

    type: str
    name: str
    framebuffer_mb: int | None
    mig_profile: str | None
    max_instance: int | None = None


def _alloc_info(a: Any) -> _AllocInfo:
    from vgpumgr import ids

    name = a.name or a.type
    parsed = ids.parse_type_name(name) if name else None
    fb = a.framebuffer_mb if a.framebuffer_mb is not None else (int(parsed.framebuffer_gb * 1024) if parsed else None)
    return _AllocInfo(a.type, name, fb, parsed.mig_profile if parsed else None)


def _label(a: Any) -> str:
    short = (a.name or a.type).split()[-1]
    return f"{short} of {a.vm}" if a.vm else f"{short} (no VM recorded)"


def held(px: Any, phys: str, region: int, allocs: Sequence[Any], homogeneous: bool = False
         ) -> list[tuple[int, int, str]]:
    """(placement id, size, label) of the time-sliced vGPUs on the GPU; unknown IDs as the driver would give.
    `homogeneous`: the GPU is in equal-size mode with placement IDs (Ada+, R570+)."""
    known: list[tuple[int, int, str]] = []
    unknown: list[tuple[Any, Any]] = []
    for a in allocs:
        info = px.info(phys, a.type) or _alloc_info(a)
        if info.mig_profile or info.framebuffer_mb is None:
            continue
        size, _ids = _slots(px, phys, info, region, homogeneous)
        if a.placement_id is not None:
            known.append((int(a.placement_id), size, _label(a)))
        else:
            unknown.append((a, info))
    for a, info in sorted(unknown, key=lambda x: (-(x[0].framebuffer_mb or 0), x[0].id)):
        size, ids = _slots(px, phys, info, region, homogeneous)
        start = pid.first_free(region, [(p, s) for p, s, _ in known], ids, size)
        if start is not None:
            known.append((start, size, _label(a)))
    return sorted(known)


def catalogue(px: Any, phys: str, region: int) -> list[pid.TypeSlots]:
    """Every time-sliced type of the GPU's model with its slots (what a choice is scored against)."""
    out: dict[tuple[int, tuple[int, ...]], pid.TypeSlots] = {}
    for info in px.catalogue.get(px.model_of(phys), {}).values():
        if info.framebuffer_mb and not info.mig_profile:
            size, ids = _slots(px, phys, info, region)
            out.setdefault((size, ids), pid.TypeSlots(info.short, size, ids))
    return list(out.values())


def mixed_choice(px: Any, g: Any, allocs: Sequence[Any], policy: Any) -> str | tuple[int, int]:
    """(placement ID, cost) for `g.info` on GPU `g.phys`, or the reason there is none."""
    info = g.info
    region_mb = px.region_mb(g.phys, info.name)
    if not region_mb:
        return f"mixed-size mode: GPU framebuffer unknown, cannot place {info.short}"
    region = region_mb // 1024
    size, ids = _slots(px, g.phys, info, region)
    taken = held(px, g.phys, region, allocs)
    occupied = [(p, s) for p, s, _ in taken]
    used = sum(s for _, s in occupied)
    short = info.short.split("-")[-1]
    if len(taken) >= pid.MAX_PER_GPU:
        return f"mixed-size mode: {len(taken)} vGPUs, the most a GPU takes"
    if not ids:
        return f"mixed-size mode: {info.short} has no placement ID on a {region} GB GPU"
    if used + size > region:
        return f"mixed-size mode: {used} of {region} GB in use, {info.short} needs {size} GB"
    free = pid.creatable(region, ids, size, occupied)
    if policy.placement_id is not None:
        want = policy.placement_id
        if want not in ids:
            return (f"placement ID {want} is not a start of {info.short} "
                    f"(its IDs: {', '.join(map(str, ids))})")
        if want not in free:
            who = pid.blockers([want], size, taken)
            return f"placement ID {want} of {info.short} is taken ({'; '.join(f'{p}: {w}' for p, w in who)})"
        return want, pid.cost(region, catalogue(px, g.phys, region), occupied, want, size)
    if not free:
        who = pid.blockers(ids, size, taken)
        return (f"{region - used} GB free on {g.phys} but no {short} start free "
                f"({', '.join(f'{p}: {w}' for p, w in who)})")
    best = pid.choose(region, catalogue(px, g.phys, region), occupied, free, size)
    assert best is not None
    return best


def is_mixed(gpu: Any) -> bool:
    """NVML says this GPU is in mixed-size mode (discovery's facts on the inventory's GPU)."""
    return nvml_mixed.mode_of(gpu.nvml if gpu is not None else None) == nvml_mixed.MIXED


def free_count(px: Any, phys: str, info: Any, allocs: Sequence[Any]) -> int:
    """How many more vGPUs of `info` fit now, counted by creatable placement IDs (not framebuffer)."""
    region_mb = px.region_mb(phys, info.name)
    if not region_mb:
        return 0
    region = region_mb // 1024
    size, ids = _slots(px, phys, info, region)
    taken = held(px, phys, region, allocs)
    count = pid.max_count(region, ids, size, pid.free_mask(region, [(s, n) for s, n, _ in taken]))
    return min(count, max(0, pid.MAX_PER_GPU - len(taken)))
