"""What a host publishes about each physical GPU: its facts, and how many more vGPUs of each type it could
take now, counted by the rules the host's own placement applies (vgpumgr.placement.placer).

Pure: a function of the placer's index of one host snapshot and the host's live records. The counts are the
answer placement would give if asked again and again for that type on that GPU alone: NVIDIA's equal-size
mode and `max_instance` per size, one vGPU per VF on SR-IOV GPUs, MIG-backed types only on a GPU in MIG mode
(a free GPU instance of the profile, or one NVML says can still be made), the driver's own listing as a veto,
and `available_instances` for everything that is not an NVIDIA type. tests/test_fleet_capacity.py checks the
counts against placement itself on every simulated profile.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF, BACKEND_VF, Gpu
from vgpumgr.placement import mixed as placement_mixed
from vgpumgr.placement.placer import Allocation, Placer, _info_from_allocation

MODE_MIG = "mig"
MODE_VENDOR_VF = "nvidia-vf"
MODE_MDEV = "mdev"
MODE_PASSTHROUGH = "passthrough"
MODE_VF = "vf"  # another vendor's SR-IOV card whose VFs VMs get whole (AMD GIM, Intel, Cambricon)
_UNBOUNDED = 1 << 30
_MAX_TIMESLICED_PER_GPU = 32  # as placement: time-sliced vGPUs per physical GPU (docs/sources.md §5)


@dataclass(frozen=True)
class TypeCapacity:
    type: str  # type id, model-local (nvidia-1148)
    name: str  # NVIDIA L40S-4Q
    short: str  # L40S-4Q: what names the type across models and hosts
    backend: str
    framebuffer_mb: int | None
    free: int  # more vGPUs of this type the GPU could take now
    used: int  # vGPUs of this type on the GPU
    max: int | None  # at most, on an empty GPU (None: not known)


@dataclass(frozen=True)
class GpuCapacity:
    address: str
    model: str
    vendor_id: str
    device_id: str
    subsystem_vendor_id: str | None
    subsystem_device_id: str | None
    driver: str | None  # the kernel driver bound to the PF
    mode: str  # mig | nvidia-vf | mdev | passthrough
    numa_node: int | None
    vgpus: int  # vGPUs on this GPU now, of any type
    types: tuple[TypeCapacity, ...] = field(default=())

    @property
    def region_mb(self) -> int | None:
        """Its largest type's framebuffer: the whole GPU (None when no type says)."""
        return max((t.framebuffer_mb for t in self.types if t.framebuffer_mb), default=None)

    @property
    def used_mb(self) -> int:
        """The framebuffer of the vGPUs on it, as its type rows say."""
        return sum(t.used * (t.framebuffer_mb or 0) for t in self.types)

    def key(self) -> tuple[Any, ...]:
        """What a publisher compares to know whether the GPU's rows changed."""
        return (self.model, self.device_id, self.subsystem_device_id, self.driver, self.mode, self.numa_node,
                self.vgpus, self.types)


def mode_of(px: Placer, g: Gpu) -> str:
    mig = (g.nvml or {}).get("mig") or {}
    if mig.get("current") == "enabled":
        return MODE_MIG
    if BACKEND_NVIDIA_VF in g.backends:
        return MODE_VENDOR_VF
    vfs = px.vfs_of.get(g.address, ())
    if BACKEND_MDEV in g.backends or any(BACKEND_MDEV in px.gpus[v].backends for v in vfs if v in px.gpus):
        return MODE_MDEV
    if BACKEND_VF in g.backends:
        return MODE_VF
    return MODE_PASSTHROUGH


def free_gpu_instances(gpus: Iterable[Gpu], records: Sequence[Allocation]) -> dict[str, list[str]]:
    """GPU-instance profiles not bound to a vGPU, per GPU in MIG mode (as `vgpumgr vm create --mig` counts)."""
    out: dict[str, list[str]] = {}
    for g in gpus:
        m = (g.nvml or {}).get("mig") or {}
        if m.get("current") != "enabled":
            continue
        names = [str(gi.get("profile")) for gi in m.get("gpu_instances") or []]
        for a in records:
            p = a.parsed.mig_profile if a.parsed else None
            if a.gpu == g.address and p in names:
                names.remove(p)
        out[g.address] = names
    return out


def host_capacity(px: Placer, records: Sequence[Allocation], only: Iterable[str] | None = None
                  ) -> list[GpuCapacity]:
    """Every physical PCI GPU of the snapshot (or those in `only`), with its capacity per type."""
    allocations, pending_keys = px.merged_allocations(records)
    by_gpu: dict[str, list[Allocation]] = {}
    for a in allocations:
        by_gpu.setdefault(a.gpu or px.physical(a.parent), []).append(a)
    wanted = None if only is None else set(only)
    gpus = [g for g in px.inv.gpus if not g.is_vf and (wanted is None or g.address in wanted)]
    free_gis = free_gpu_instances(gpus, records)
    out = []
    for g in sorted(gpus, key=lambda g: g.address):
        load = _Load(px, g, by_gpu.get(g.address, []), pending_keys, free_gis)
        cat = px.catalogue.get(px.model_of(g.address), {})
        types = tuple(sorted((_type_capacity(px, g, info, load) for info in cat.values() if info.type),
                             key=lambda t: (t.framebuffer_mb or 0, t.name, t.type)))
        out.append(GpuCapacity(g.address, g.name, g.vendor_id, g.device_id, g.subsystem_vendor_id,
                               g.subsystem_device_id, g.driver, mode_of(px, g), g.numa_node, len(load.allocs), types))
    return out


def mixed_size_free(px: Placer, records: Sequence[Allocation], only: Iterable[str] | None = None
                    ) -> dict[str, dict[str, int]]:
    """GPU -> type id -> vGPUs of the type it could take now, one after the other (host_capacity's count), for
    each physical GPU in NVIDIA's mixed-size mode (of those in `only`). There every free VF lists every type that
    fits somewhere, so the VFs' `available_instances` are true per VF but never add up to what can be made."""
    wanted = None if only is None else set(only)
    mixed = [g.address for g in px.inv.gpus if not g.is_vf and placement_mixed.is_mixed(g)
             and (wanted is None or g.address in wanted)]
    if not mixed:
        return {}
    return {c.address: {t.type: t.free for t in c.types} for c in host_capacity(px, records, mixed)}


class _Load:
    """What one GPU holds, read once for all of its types."""

    def __init__(self, px: Placer, g: Gpu, allocs: list[Allocation], pending_keys: set[Any],
                 free_gis: Mapping[str, list[str]]) -> None:
        self.allocs = allocs
        infos = [(a, px.info(g.address, a.type) or _info_from_allocation(a)) for a in allocs]
        self.sliced = [a for a, i in infos if not i.mig_profile]
        self.mig_backed = len(self.sliced) < len(infos)
        self.sizes = {a.framebuffer_mb for a in self.sliced if a.framebuffer_mb is not None}
        self.used: dict[str, int] = {}
        for a in allocs:
            self.used[a.type] = self.used.get(a.type, 0) + 1
        self.pending = [a for a in allocs if a.key in pending_keys]
        self.pending_profiles = [i.mig_profile for a, i in infos if a.key in pending_keys and i.mig_profile]
        self.free_gis = free_gis.get(g.address)  # None: MIG is off
        self.mixed = placement_mixed.is_mixed(g)  # once per GPU, not per type (a publish's ~20 %)
        vfs = px.vfs_of.get(g.address)
        busy = {a.parent for a in allocs}
        self.vfs = vfs
        self.free_vfs = [v for v in vfs if v not in busy] if vfs else []


def _type_capacity(px: Placer, g: Gpu, info: Any, load: _Load) -> TypeCapacity:
    used = load.used.get(info.type, 0)
    listed = px.listings.get((g.address, info.type), [])
    if not info.nvidia:
        free = sum(max(0, t.available_instances - sum(1 for a in load.pending if a.parent == t.parent
                                                        and a.type == t.type)) for t in listed)
        return TypeCapacity(info.type, info.name, info.short, info.backend, None, free, used, used + free)
    limit = _limit(px, g, info)
    free, made = _nvidia_free(g, info, load, limit)
    if not info.mig_profile and not load.mig_backed and load.mixed:
        free = placement_mixed.free_count(px, g.address, info, load.sliced)  # creatable placements, not sizes
    if free > 0 or made > 0:
        parents, spare = _parents_free(listed, load)
        # a GPU instance still to be made has no listing yet: it needs only a free VF
        free = min(free, parents)
        free += min(made, spare - free)
    return TypeCapacity(info.type, info.name, info.short, info.backend, info.framebuffer_mb, free, used, limit)


def _limit(px: Placer, g: Gpu, info: Any) -> int | None:
    """max_instance from the type, else the GPU's framebuffer over the type's, capped at 32 (as placement)."""
    if info.max_instance:
        return int(info.max_instance)
    region = px.region_mb(g.address, info.name)
    if region and info.framebuffer_mb:
        return max(1, min(_MAX_TIMESLICED_PER_GPU, region // info.framebuffer_mb))
    return None


def _nvidia_free(g: Gpu, info: Any, load: _Load, limit: int | None) -> tuple[int, int]:
    """(vGPUs the GPU's rules allow now, more that need a GPU instance made first)."""
    if info.mig_profile:
        if load.sliced or load.free_gis is None:
            return 0, 0
        taken = sum(1 for p in load.pending_profiles if p == info.mig_profile)
        existing = sum(1 for p in load.free_gis if p == info.mig_profile) - taken
        return max(0, existing), _remaining(g, info.mig_profile)
    if load.mig_backed or load.free_gis is not None:
        return 0, 0  # MIG mode, or MIG-backed vGPUs: no time-sliced ones
    if load.sizes - {info.framebuffer_mb or 0}:
        return 0, 0  # equal-size mode: one framebuffer size per GPU
    return (max(0, limit - len(load.sliced)) if limit is not None else 0), 0


def _remaining(g: Gpu, profile: str) -> int:
    """GPU instances of `profile` NVML says could still be made (nvmlDeviceGetGpuInstanceRemainingCapacity)."""
    for p in ((g.nvml or {}).get("mig") or {}).get("profiles") or []:
        if p.get("name") == profile and isinstance(p.get("remaining"), int):
            return int(p["remaining"])
    return 0


def _parents_free(listed: list[Any], load: _Load) -> tuple[int, int]:
    """(parents the driver lists the type on that could take one more, free parents at all): the driver's
    listing vetoes, and a VF holds one vGPU."""
    if not load.vfs:
        if not listed:
            return 0, 0
        t = listed[0]
        n = t.available_instances if t.backend == BACKEND_MDEV else _UNBOUNDED
        return n, n
    creatable = {t.parent for t in listed if t.backend == BACKEND_NVIDIA_VF or t.available_instances > 0}
    return sum(1 for v in load.free_vfs if v in creatable), len(load.free_vfs)
