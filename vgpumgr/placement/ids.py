"""NVIDIA mixed-size ("heterogeneous") vGPU mode: placement IDs, what is creatable, and which ID to take.

In mixed-size mode a time-sliced vGPU of placement size `s` GB occupies IDs `[id, id + s)` of a placement
region the size of the GPU's nominal memory in GB, and each type may start only at its supported IDs
(docs/sources.md §21). Pure functions: the simulator, the placer and the benchmark share them.

- `supported(region, size, max_instance, arch)`: the driver's partition algorithm (pre-Blackwell: halve the
  region down to sixteenths; Blackwell: `floor(region * j / max)`), with the 1 GB deny lists of 48 GB GPUs.
- `creatable(region, ids, size, occupied)`: the supported IDs whose whole range is free now.
- `choose(...)`: vgpumgr's default policy, best fit scored by what each start costs the GPU's types (`cost`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

AMPERE, ADA, HOPPER, BLACKWELL = "ampere", "ada", "hopper", "blackwell"
ARCHES = (AMPERE, ADA, HOPPER, BLACKWELL)
MAX_PER_GPU = 32  # time-sliced vGPUs per physical GPU
INVALID = 0xFFFF  # NVML_INVALID_VGPU_PLACEMENT_ID

# 1 GB profiles (guest FB exactly 1 GiB) refused at these IDs; only a 48 GB region reaches them: the
# published 24/20/16 GB tables keep every 1 GB ID of the algorithm.
_DENY_1GB = {
    ADA: frozenset({2, 3, 8, 9, 14, 15, 20, 21, 26, 27, 32, 33, 38, 39, 44, 45}),
    HOPPER: frozenset({2, 3, 8, 9, 14, 15, 20, 21, 26, 27, 32, 33, 38, 39, 44, 45}),
    AMPERE: frozenset({8, 32}),
}

Occupied = Sequence[tuple[int, int]]  # (placement id, placement size) of the vGPUs on a GPU


def placement_size(region_gb: int, size_gb: int, arch: str = ADA) -> int:
    """GB slots a type takes: its size, except the 2 GB profile of a 96 GB Blackwell GPU (3)."""
    if arch == BLACKWELL and region_gb == 96 and size_gb == 2:
        return 3
    return max(size_gb, 1)


def equal_max(region_gb: int, size_gb: int) -> int:
    """The equal-size maximum of a type: what fits, capped at 32 per GPU."""
    return max(1, min(MAX_PER_GPU, region_gb // max(size_gb, 1)))


@lru_cache(maxsize=2048)
def supported(region_gb: int, size_gb: int, max_instance: int | None = None, arch: str = ADA) -> tuple[int, ...]:
    """The heterogeneous placement IDs of a type of `size_gb` with equal-size maximum `max_instance`."""
    if size_gb <= 0 or size_gb > region_gb:
        return ()
    m = max_instance or equal_max(region_gb, size_gb)
    psize = placement_size(region_gb, size_gb, arch)
    if arch == BLACKWELL:
        return tuple(sorted({region_gb * j // m for j in range(m)}))
    found: list[int] = []
    prev_pow2 = 1
    while prev_pow2 * 2 <= m:
        prev_pow2 *= 2
    # partitions at each level, in address order: (lo, hi); halves split as floor / rest
    level = [(0, region_gb)]
    parts = 1
    while parts <= 16:
        if 2 * parts == m:
            for lo, hi in level:
                found += [lo, hi - psize]
        elif (prev_pow2 == parts and prev_pow2 != m) or (parts == 1 and m == 1):
            for i, (lo, hi) in enumerate(level):
                found.append(lo if i % 2 == 0 else hi - psize)
        level = [half for lo, hi in level for half in ((lo, lo + (hi - lo) // 2), (lo + (hi - lo) // 2, hi))]
        parts *= 2
    deny = _DENY_1GB.get(arch, frozenset()) if size_gb == 1 and region_gb == 48 else frozenset()
    return tuple(sorted({p for p in found if 0 <= p <= region_gb - psize and p not in deny}))


def homogeneous(size_gb: int, max_instance: int) -> tuple[int, ...]:
    """Equal-size-mode placement IDs (Ada and newer, R570+): `j * size` for j < max_instance."""
    return tuple(j * size_gb for j in range(max_instance))


def homogeneous_slots(region_gb: int, size_gb: int, max_instance: int, arch: str = ADA) -> tuple[int, tuple[int, ...]]:
    """(placement size, equal-size-mode IDs) of a type: `j * placementSize` for j < max_instance, within the
    region (the driver's `homogeneousSupportedPlacementId`)."""
    size = placement_size(region_gb, size_gb, arch)
    return size, homogeneous(size, min(max_instance, region_gb // size))


def creatable_in_mode(region_gb: int, ids: Iterable[int], size: int, occupied: Occupied, *, equal: bool
                      ) -> list[int]:
    """`creatable`, and in equal-size mode (homogeneous IDs) none for another size than the vGPUs' (the driver
    clears every other size's IDs while a vGPU exists)."""
    if equal and any(s != size for _, s in occupied):
        return []
    return creatable(region_gb, ids, size, occupied)


def free_mask(region_gb: int, occupied: Occupied) -> list[bool]:
    used = [False] * region_gb
    for start, size in occupied:
        for i in range(max(start, 0), min(start + size, region_gb)):
            used[i] = True
    return used


def creatable(region_gb: int, ids: Iterable[int], size: int, occupied: Occupied) -> list[int]:
    """The IDs among `ids` whose whole range `[id, id + size)` is free."""
    used = free_mask(region_gb, occupied)
    return [p for p in ids if p + size <= region_gb and not any(used[p:p + size])]


@dataclass(frozen=True)
class TypeSlots:
    """One time-sliced type of a GPU: its placement size and supported IDs (mixed-size mode)."""

    name: str
    size: int
    ids: tuple[int, ...]


def catalogue(region_gb: int, sizes: Mapping[str, tuple[int, int | None]], arch: str = ADA) -> list[TypeSlots]:
    """TypeSlots for `{name: (size_gb, max_instance)}`."""
    out = []
    for name, (size, maxi) in sizes.items():
        ids = supported(region_gb, size, maxi, arch)
        if ids:
            out.append(TypeSlots(name, placement_size(region_gb, size, arch), ids))
    return out


def max_count(region_gb: int, ids: Iterable[int], size: int, used: Sequence[bool]) -> int:
    """How many vGPUs of one type still fit side by side in the free slots `used` marks (one placement size:
    taking the earliest-ending free start each time is a maximum set)."""
    count, end = 0, -1
    for p in ids:
        if p >= end and p + size <= region_gb and not any(used[p:p + size]):
            count, end = count + 1, p + size
    return count


def cost(region_gb: int, types: Sequence[TypeSlots], occupied: Occupied, start: int, size: int) -> int:
    """What taking `[start, start + size)` costs the GPU's types: for each type, how many fewer of it still fit
    side by side, times its size (the GB of that type the choice gives away). The same number on any GPU of a
    fleet, so it ranks GPUs as well as starts: a start that leaves every other type's count whole costs 0."""
    before = free_mask(region_gb, occupied)
    after = list(before)
    for i in range(start, start + size):
        after[i] = True
    lost = 0
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for t in types:
        if (t.size, t.ids) in seen:
            continue
        seen.add((t.size, t.ids))
        lost += t.size * (max_count(region_gb, t.ids, t.size, before) - max_count(region_gb, t.ids, t.size, after))
    return lost


def choose(region_gb: int, types: Sequence[TypeSlots], occupied: Occupied, ids: Iterable[int],
           size: int) -> tuple[int, int] | None:
    """vgpumgr's default start among the creatable `ids`: the least `cost`, then the lowest ID. Returns
    (id, cost) or None when none is creatable."""
    best: tuple[int, int] | None = None
    for p in creatable(region_gb, ids, size, occupied):
        c = cost(region_gb, types, occupied, p, size)
        if best is None or c < best[1]:
            best = (p, c)
    return best


def pack_order(cost_gb: float, share: float) -> tuple[float, float]:
    """How `pack` ranks the (GPU, placement ID) choices of a fleet in mixed-size mode: the least `cost` (the
    same units on every GPU), then the fullest GPU (`share` of its framebuffer in use)."""
    return cost_gb, -share


def first_free(region_gb: int, occupied: Occupied, ids: Iterable[int], size: int) -> int | None:
    """The driver's own choice when none is given: the first creatable ID."""
    found = creatable(region_gb, ids, size, occupied)
    return found[0] if found else None


def blockers(ids: Iterable[int], size: int, held: Sequence[tuple[int, int, str]]) -> list[tuple[int, str]]:
    """For each supported start of a type, the first vGPU in its way: [(start, label)] from
    `held` = [(id, size, label)]."""
    out = []
    for p in ids:
        for start, hsize, label in sorted(held):
            if start < p + size and p < start + hsize:
                out.append((p, label))
                break
    return out


def fewest_moves(supported: Sequence[int], size: int, vgpus: Sequence[tuple[int, int, str | None]]
                 ) -> tuple[int, int, int, list[tuple[int, int, str | None]]] | None:
    """(moves, GB moved, start, the vGPUs in its way) of the start of a type of placement size `size` that
    needs the fewest moves (then the fewest GB, then the lowest start); `vgpus`: (placement id, size, VM or
    None). A start held by a vGPU without a VM cannot be freed by a migration; None when no start can."""
    options = every_start(supported, size, vgpus)
    return options[0] if options else None


def every_start(supported: Sequence[int], size: int, vgpus: Sequence[tuple[int, int, str | None]]
                ) -> list[tuple[int, int, int, list[tuple[int, int, str | None]]]]:
    """(moves, GB moved, start, the vGPUs in its way) of every start that migrations can free, fewest moves first
    (then GB, then start): `fleet compact` tries them all, since the fewest start's VMs may have nowhere to go
    while another start's do."""
    options = []
    for s in supported:
        way = [v for v in vgpus if v[0] < s + size and s < v[0] + v[1]]
        if any(v[2] is None for v in way):
            continue
        options.append((len(way), sum(v[1] for v in way), s, way))
    return sorted(options, key=lambda o: o[:3])
