#!/usr/bin/env python3
"""How densely mixed vGPU sizes pack: seeded arrival/departure traces on 8 GPUs of 48 GB and of 80 GB.

Rows, per trace: (a) equal-size mode (one size per GPU at a time), (b) mixed-size mode with the driver's own
choice (first GPU that can, first creatable placement ID: NVIDIA reserves the first free ID when the vGPU is
made), (c) mixed-size mode with vgpumgr's policy (the functions `vm create` ranks by: `placement_ids.choose` on
each GPU against the model's every size, then `placement_ids.pack_order` across the GPUs; a test replays a
trace through `placement.place` on simulated L40S GPUs and gets the same choices), and (d) the offline optimum
for the trace's prefix: the most arrivals that some placement, knowing the whole trace, accepts in full. (d) is
printed as one number where proved and as `lo-hi` where not: lo is a placement found (an online row's or a
depth-first search's), hi the first arrival at which the VMs present need more GB than the GPUs have or cannot
be packed on them even placed afresh; an exhaustive search that finds no placement of lo + 1 proves lo. The
upper end is searched first with the trace played backwards (`backwards`), where the fullest moment comes first.

Columns: VMs accepted before the first refusal, and the share of all arrivals accepted when refused VMs are
dropped and the trace goes on. Targets (issue 41; the room left on one GPU is made by moving VMs across hosts,
scripts/bench_fleet_density.py): (c) >= (b) summed over the traces, and (c) within 5 % of (d) on every trace.
Within 5 % counts as met only where proved against hi; "unproved" where (c) is within 5 % of lo but not of hi.
The gain over (b) is still printed.

    python3 scripts/bench_mixed.py [--seeds 2] [--events 240] [--budget 20000] [--decisive [--odds 2000]]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vgpumgr.placement import ids as pid  # noqa: E402

GPUS = 8
SIZES = {48: (2, 4, 8, 12, 16, 24), 80: (4, 5, 8, 10, 16, 20, 40)}
# every time-sliced size of the GPU model (an L40S; NVIDIA's published 80 GB table): what vgpumgr's cost
# weighs a choice against, as placement_mixed.catalogue gives it in production
MODEL_SIZES = {48: (1, 2, 3, 4, 6, 8, 12, 16, 24, 48), 80: (4, 5, 8, 10, 16, 20, 40, 80)}
# trace name -> size weights (by position in SIZES[region]); "uniform" is one size only
MIXES = {"mixed-even": "even", "mixed-large": "large", "uniform": "one"}

Event = tuple[str, int, int]  # ("arrive", vm, size) or ("leave", vm, 0)
Gpu = list[tuple[int, int, int]]  # (placement id, size, vm)
Placer = Callable[[list[Gpu], int], tuple[int, int] | None]


def trace(region: int, mix: str, seed: int, events: int) -> list[Event]:
    """Arrivals and departures (60 % arrivals once the GPUs are in use, so they saturate): "even" draws every
    size alike, "large" favours the largest and smallest sizes, "one" is a single size."""
    rng = random.Random(f"{region}-{mix}-{seed}")
    sizes, weights = SIZES[region], _weights(region, mix)
    out: list[Event] = []
    live: list[int] = []
    vm = 0
    for _ in range(events):
        if live and rng.random() > ARRIVING:
            out.append(("leave", live.pop(rng.randrange(len(live))), 0))
        else:
            vm += 1
            out.append(("arrive", vm, rng.choices(sizes, weights)[0]))
            live.append(vm)
    return out


ARRIVING = 0.6  # an event's chance to be an arrival (while a VM is present)


def _weights(region: int, mix: str) -> list[int]:
    sizes = SIZES[region]
    if mix == "one":
        return [1 if s == sizes[1] else 0 for s in sizes]
    if mix == "large":
        return [2, 2, 1, 1, 2, 3, 3][:len(sizes)]
    return [1] * len(sizes)


def slots(region: int) -> dict[int, tuple[int, ...]]:
    return {s: pid.supported(region, s) for s in SIZES[region]}


# -- the placers: (gpus, size) -> (gpu index, placement id) or None -------------------------------------------


def equal_size(region: int) -> Placer:
    def place(gpus: list[Gpu], size: int) -> tuple[int, int] | None:
        maxi = pid.equal_max(region, size)
        order = sorted(range(len(gpus)), key=lambda i: (not gpus[i], i))  # pack: GPUs in use first
        for i in order:
            g = gpus[i]
            if (not g or g[0][1] == size) and len(g) < maxi:
                ids = pid.homogeneous(size, maxi)
                free = pid.creatable(region, ids, size, [(p, s) for p, s, _ in g])
                return (i, free[0]) if free else None
        return None
    return place


def driver_first_free(region: int) -> Placer:
    table = slots(region)

    def place(gpus: list[Gpu], size: int) -> tuple[int, int] | None:
        for i, g in enumerate(gpus):
            p = pid.first_free(region, [(a, s) for a, s, _ in g], table[size], size)
            if p is not None:
                return i, p
        return None
    return place


def vgpumgr_policy(region: int) -> Placer:
    """What `vm create` decides with the default `pack` policy: on every GPU the start `placement_ids.choose`
    picks (scored against every time-sliced type of the GPU's model, as `placement_mixed` scores it), and of
    those the first by `placement_ids.pack_order` (the functions `placement._evaluate` ranks candidates by)."""
    table = slots(region)
    types = [pid.TypeSlots(str(s), s, pid.supported(region, s)) for s in MODEL_SIZES[region]]

    def place(gpus: list[Gpu], size: int) -> tuple[int, int] | None:
        best: tuple[tuple[float, ...], int, int] | None = None
        for i, g in enumerate(gpus):
            occupied = [(a, s) for a, s, _ in g]
            got = pid.choose(region, types, occupied, table[size], size)
            if got is None:
                continue
            key = (*pid.pack_order(got[1], sum(s for _, s in occupied) / region), i)
            if best is None or key < best[0]:
                best = (key, i, got[0])
        return None if best is None else (best[1], best[2])
    return place


def _arrivals(events: Sequence[Event], place: Placer) -> Iterator[tuple[int, int, list[Gpu], tuple[int, int] | None]]:
    """Each arrival: (vm, size, the GPUs as `place` left them just before it, where `place` puts it or None), placed
    once the caller moves on."""
    gpus: list[Gpu] = [[] for _ in range(GPUS)]
    where: dict[int, int] = {}
    for kind, vm, size in events:
        if kind == "leave":
            if vm in where:
                g = gpus[where.pop(vm)]
                g[:] = [x for x in g if x[2] != vm]
            continue
        got = place(gpus, size)
        yield vm, size, gpus, got
        if got is not None:
            i, p = got
            gpus[i].append((p, size, vm))
            gpus[i].sort()
            where[vm] = i


def replay(events: Sequence[Event], place: Placer) -> tuple[int, float]:
    accepted = arrivals = 0
    first_refusal: int | None = None
    for _, _, _, got in _arrivals(events, place):
        arrivals += 1
        if got is None:
            if first_refusal is None:
                first_refusal = accepted
            continue
        accepted += 1
    return (accepted if first_refusal is None else first_refusal), accepted / max(arrivals, 1)


# -- (d): the longest prefix of arrivals that some placement accepts in full ----------------------------------


class _Budget(Exception):
    pass


class _Slots:
    """A region cut into the blocks no start of `sizes` crosses (the halves of a GPU: NVIDIA's algorithm starts
    every type of up to half the region inside one half), each block's starts as offsets, with the second half
    mirrored where that makes the two alike (then every block is the same and the search treats equal ones once);
    bit masks of the starts and the most GB a set of sizes can still fill around a mask."""

    def __init__(self, region: int, sizes: Sequence[int]) -> None:
        self.region = region
        full = {s: pid.supported(region, s) for s in sizes}
        half = region // 2
        first = {s: tuple(p for p in full[s] if p + s <= half) for s in sizes}
        second = {s: tuple(p - half for p in full[s] if p >= half) for s in sizes}
        mirrored = {s: tuple(sorted(half - o - s for o in second[s])) for s in sizes}
        whole = all(len(first[s]) + len(second[s]) == len(full[s]) for s in sizes)
        if whole and (second == first or mirrored == first):
            self.unit, self.per_gpu, self.ids = half, 2, first
            self.flip = second != first  # the second half's offsets run backwards
        else:
            self.unit, self.per_gpu, self.ids, self.flip = region, 1, full, False
        # a block whose mirror image has the same starts: a block and its mirror are one state
        self.symmetric = all(tuple(sorted(self.unit - o - s for o in self.ids[s])) == self.ids[s] for s in sizes)
        self.span = {(p, s): ((1 << s) - 1) << p for s in sizes for p in self.ids[s]}
        self._fill: dict[tuple[int, tuple[int, ...]], int] = {}

    def block(self, start: int, size: int) -> tuple[int, int]:
        """(block of the GPU, offset in it) of a start on the GPU."""
        if self.per_gpu == 1:
            return 0, start
        if start < self.unit:
            return 0, start
        return 1, (self.unit - (start - self.unit) - size) if self.flip else start - self.unit

    def canonical(self, vgpus: tuple[tuple[int, int, int], ...]) -> tuple[tuple[int, int, int], ...]:
        if not self.symmetric:
            return vgpus
        return min(vgpus, tuple(sorted((self.unit - o - s, s, d) for o, s, d in vgpus)))

    def fill(self, mask: int, sizes: tuple[int, ...]) -> int:
        """Most GB that vGPUs of `sizes` (any number of each) cover in the free slots of `mask`."""
        key = (mask, sizes)
        if key not in self._fill:
            best = [0] * (self.unit + 1)
            for x in range(self.unit - 1, -1, -1):
                b = best[x + 1]
                for s in sizes:
                    span = self.span.get((x, s))
                    if span is not None and not mask & span:
                        b = max(b, s + best[x + s])
                best[x] = b
            self._fill[key] = best[0]
        return self._fill[key]

    def room(self, masks: Sequence[int], sizes: Sequence[int]) -> bool:
        """A necessary condition for `sizes` to fit around `masks`: for each size, the vGPUs at least that large
        fit in the GB that such sizes can still cover."""
        kinds = sorted(set(sizes), reverse=True)
        for n in range(1, len(kinds) + 1):
            need = sum(s for s in sizes if s >= kinds[n - 1])
            if sum(self.fill(m, tuple(kinds[:n])) for m in masks) < need:
                return False
        return True


def _packs(sl: _Slots, sizes: Sequence[int], budget: int, held: Sequence[int] = ()) -> bool | None:
    """Do `sizes` fit at once on GPUS GPUs whose slots `held` (bit masks) are taken, each at a placement ID of
    its own (no history)? None: the budget ran out first."""
    items = sorted(sizes, reverse=True)
    masks = list(held) or [0] * (GPUS * sl.per_gpu)
    failed: set[tuple[int, tuple[int, ...]]] = set()
    nodes = 0

    def rec(k: int) -> bool:
        nonlocal nodes
        if k == len(items):
            return True
        nodes += 1
        if nodes > budget:
            raise _Budget
        key = (k, tuple(sorted(masks)))
        if key in failed or not sl.room(masks, items[k:]):
            failed.add(key)
            return False
        s, tried = items[k], set()
        for i, m in enumerate(masks):
            if m in tried:
                continue
            tried.add(m)
            for p in sl.ids[s]:
                if not m & sl.span[(p, s)]:
                    masks[i] = m | sl.span[(p, s)]
                    found = rec(k + 1)
                    masks[i] = m
                    if found:
                        return True
        failed.add(key)
        return False

    try:
        return rec(0)
    except _Budget:
        return None


def upper_bound(region: int, events: Sequence[Event], lo: int, budget: int = 20_000) -> int:
    """No placement accepts more arrivals in full than this: at the first arrival after which the VMs present
    need more GB than the GPUs have, or (checked from `lo` on) cannot be packed on the GPUs even if placed
    afresh, the prefix ends."""
    sl = _Slots(region, SIZES[region])
    live: dict[int, int] = {}
    n = 0
    for kind, vm, size in events:
        if kind == "leave":
            live.pop(vm, None)
            continue
        live[vm] = size
        if sum(live.values()) > GPUS * region or (n >= lo and _packs(sl, list(live.values()), budget) is False):
            return n
        n += 1
    return n


def lower_bound(region: int, events: Sequence[Event], target: int, budget: int,
                start: tuple[int, list[Gpu]] | None = None) -> tuple[int, bool]:
    """The most arrivals a depth-first search over every (GPU, placement ID) accepts in full, up to `target`:
    (count, whether the search was exhaustive, proving `target` out of reach when count < target). It places
    in the GPUs' halves (`_Slots`), starts tried cheapest first by vgpumgr's cost, alike halves once, and a
    state (every half's vGPUs by offset, size and departure, halves in any order) that failed before is not
    tried again; a state whose later arrivals cannot fit (the `room`
    test at each later arrival) is cut. `start`: (arrivals already placed, the GPUs then), to search on from an
    online row's state."""
    arrivals = [i for i, (kind, _, _) in enumerate(events) if kind == "arrive"][:target]
    last = arrivals[-1]
    events = events[:last + 1]
    never = len(events)
    leaves = {vm: i for i, (kind, vm, _) in enumerate(events) if kind == "leave"}
    todo = [(i, events[i][2], leaves.get(events[i][1], never)) for i in arrivals]  # (step, size, departure)
    sl = _Slots(region, SIZES[region])
    types = [pid.TypeSlots(str(s), s, sl.ids[s]) for s in SIZES[region]]
    blocks: list[list[tuple[int, int, int]]] = [[] for _ in range(GPUS * sl.per_gpu)]  # (offset, size, departure)
    first, step0 = 0, 0
    if start is not None:
        first, held = start
        step0 = arrivals[first] if first < len(arrivals) else len(events)
        for g, vgpus in enumerate(held):
            for p, size, vm in vgpus:
                half, offset = sl.block(p, size)
                if leaves.get(vm, never) > step0:  # not gone before the search begins
                    blocks[g * sl.per_gpu + half].append((offset, size, leaves.get(vm, never)))
        for b in blocks:
            b.sort()
    failed: set[tuple[int, tuple[tuple[tuple[int, int, int], ...], ...]]] = set()
    nodes = deepest = 0

    size_of = {events[i][1]: events[i][2] for i in arrivals}
    live_gb, gb = {}, 0
    for i, (kind, vm, size) in enumerate(events):
        gb += size if kind == "arrive" else -size_of[vm]
        live_gb[i] = gb
    tight = {st for st, _, _ in todo if live_gb[st] >= 0.9 * GPUS * region} | {last}
    packed: dict[tuple[int, tuple[int, ...]], bool | None] = {}

    def later_fit(j: int) -> bool:
        """Can the arrivals from the j-th on still fit, at each later arrival, around the vGPUs placed so far
        that are still there then (placed afresh, so a necessary condition)?"""
        for step, _, _ in todo[j:]:
            coming = [s for st, s, dep in todo[j:] if st <= step < dep]
            if not coming:
                continue
            masks = [sum(sl.span[(p, s)] for p, s, dep in g if dep > step) for g in blocks]
            if not sl.room(masks, coming):
                return False
            if step in tight:
                key = (step, tuple(sorted(masks)))
                if key not in packed:
                    packed[key] = _packs(sl, coming, 300, masks)
                if packed[key] is False:
                    return False
        return True

    def search(k: int, j: int) -> bool:
        nonlocal nodes, deepest
        deepest = max(deepest, j)
        if j == len(todo):
            return True
        nodes += 1
        if nodes > budget:
            raise _Budget
        kind = events[k][0]
        if kind == "leave":
            for g in blocks:
                for x in g:
                    if x[2] == k:
                        g.remove(x)
                        found = search(k + 1, j)
                        g.append(x)
                        g.sort()
                        return found
            return search(k + 1, j)
        state = (k, tuple(sorted(sl.canonical(tuple(g)) for g in blocks)))
        if state in failed or not later_fit(j):
            failed.add(state)
            return False
        _, size, dep = todo[j]
        options, seen = [], set()
        for i, g in enumerate(blocks):
            if sl.canonical(tuple(g)) in seen:
                continue
            seen.add(sl.canonical(tuple(g)))
            occupied = [(p, s) for p, s, _ in g]
            for p in pid.creatable(sl.unit, sl.ids[size], size, occupied):
                options.append((*pid.pack_order(pid.cost(sl.unit, types, occupied, p, size),
                                                sum(s for _, s in occupied) / sl.unit), i, p))
        for *_order, i, p in sorted(options):
            blocks[i].append((p, size, dep))
            blocks[i].sort()
            if search(k + 1, j + 1):
                return True
            blocks[i].remove((p, size, dep))
        failed.add(state)
        return False

    sys.setrecursionlimit(10_000)
    try:
        search(step0, first)
    except _Budget:
        return deepest, False
    return deepest, True


def backwards(events: Sequence[Event], n: int) -> list[Event]:
    """The first `n` arrivals played backwards: the VMs present at the n-th arrival come first (largest first),
    each departure becomes an arrival and each arrival a departure. VMs share the GPUs at the same moments, so a
    placement accepts one in full exactly when it accepts the other; the search meets the fullest moment, where
    few placements remain, first instead of last."""
    end = [i for i, (kind, _, _) in enumerate(events) if kind == "arrive"][n - 1]
    prefix = events[:end + 1]
    size = {vm: s for kind, vm, s in prefix if kind == "arrive"}
    gone = {vm for kind, vm, _ in prefix if kind == "leave"}
    out: list[Event] = [("arrive", vm, s) for vm, s in sorted(size.items(), key=lambda v: -v[1]) if vm not in gone]
    for kind, vm, _ in reversed(prefix):
        out.append(("arrive", vm, size[vm]) if kind == "leave" else ("leave", vm, 0))
    return out


def optimum(region: int, events: Sequence[Event], known: int, budget: int = 20_000, back: int = 400
            ) -> tuple[int, int]:
    """(lo, hi): the offline optimum lies between; equal when proved. `known`: a count an online row reached
    (its placements accept that prefix in full). The upper end is searched backwards first (`back` nodes a
    try: the fullest moment decides it quickly or not at all), then forwards from the lower end."""
    hi = upper_bound(region, events, known)
    lo = known
    while lo < hi:
        got, exhaustive = lower_bound(region, backwards(events, hi), hi, back)
        if got < hi and not exhaustive:
            break
        lo, hi = (hi, hi) if got >= hi else (lo, hi - 1)
    while lo < hi:
        got, exhaustive = lower_bound(region, events, lo + 1, budget)
        if got > lo:
            lo = got
        elif exhaustive:  # every placement of the first lo + 1 arrivals was tried: none accepts them all
            hi = lo
        else:
            break
    return lo, hi


def before(events: Sequence[Event], place: Placer, k: int) -> tuple[Event, list[Gpu]]:
    """The k-th arrival (from 0) and the GPUs as `place` left them just before it (every earlier one accepted)."""
    for seen, (vm, size, gpus, got) in enumerate(_arrivals(events, place)):
        if seen == k:
            return ("arrive", vm, size), gpus
        assert got is not None, "before: an earlier arrival was refused"
    raise ValueError(f"before: the trace has no arrival {k}")


def decisive(region: int, events: Sequence[Event], first: int, need: int, budget: int = 20_000
             ) -> tuple[int, list[tuple[int, int, int, bool | None]]] | None:
    """The online row (c)'s last choice after which no placement reaches `need` arrivals in full: (its arrival, and
    for every (GPU, start) it could have taken there: GPU, start, vgpumgr's cost, whether `need` stays
    reachable). `first`: (c)'s count (it reaches that far). None when the search could not tell."""
    place = vgpumgr_policy(region)
    types = [pid.TypeSlots(str(s), s, pid.supported(region, s)) for s in MODEL_SIZES[region]]

    def reachable(k: int, gpus: list[Gpu]) -> bool | None:
        got, exhaustive = lower_bound(region, events, need, budget, (k, gpus))
        return True if got >= need else False if exhaustive else None

    # from the last arrival back: the later the state, the fewer arrivals are left to search
    lo = first
    while True:
        got = reachable(lo, before(events, place, lo)[1])
        if got is None or (got is False and lo == 0):
            return None
        if got:
            break
        lo -= 1
    if lo == first:
        return None
    (_, vm, size), gpus = before(events, place, lo)
    options = []
    for i, g in enumerate(gpus):
        occupied = [(p, s) for p, s, _ in g]
        for p in pid.creatable(region, pid.supported(region, size), size, occupied):
            after = [list(x) for x in gpus]
            after[i] = sorted(after[i] + [(p, size, vm)])
            options.append((i, p, pid.cost(region, types, occupied, p, size), reachable(lo + 1, after)))
    return lo, options


class Masks:
    """Row (c) on bit masks (a GPU's used GB as the bits of an int), its costs cached per mask: the same choices as
    vgpumgr_policy (tests/test_bench_mixed_policy.py), fast enough for the odds' hundreds of thousands."""

    def __init__(self, region: int) -> None:
        self.types: list[tuple[int, tuple[tuple[int, int], ...]]] = []  # each distinct type once, as ids.cost
        for s in MODEL_SIZES[region]:
            starts = tuple((p, ((1 << s) - 1) << p) for p in pid.supported(region, s) if p + s <= region)
            if all((s, starts) != t for t in self.types):
                self.types.append((s, starts))
        self.starts = {s: tuple((p, ((1 << s) - 1) << p) for p in pid.supported(region, s)) for s in SIZES[region]}
        self._counts: dict[int, tuple[int, ...]] = {}
        self._choice: dict[tuple[int, int], list[tuple[int, int, int]]] = {}

    def counts(self, mask: int) -> tuple[int, ...]:
        """How many of each type still fit side by side (ids.max_count)."""
        if mask not in self._counts:
            out = []
            for s, starts in self.types:
                n, end = 0, -1
                for p, span in starts:
                    if p >= end and not mask & span:
                        n, end = n + 1, p + s
                out.append(n)
            self._counts[mask] = tuple(out)
        return self._counts[mask]

    def options(self, mask: int, size: int) -> list[tuple[int, int, int]]:
        """(cost, start, span) of every creatable start, in start order (ids.cost)."""
        key = (mask, size)
        if key not in self._choice:
            before = self.counts(mask)
            self._choice[key] = [(sum(s * (b - a) for (s, _), b, a in zip(self.types, before, self.counts(
                mask | span), strict=True)), p, span) for p, span in self.starts[size] if not mask & span]
        return self._choice[key]

    def place(self, masks: Sequence[int], size: int) -> tuple[int, int, int] | None:
        """(GPU, start, span) as vgpumgr_policy: the least cost (then the lowest start) on each GPU, then the least
        cost, the fullest GPU, the first."""
        best: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None
        for i, m in enumerate(masks):
            found = self.options(m, size)
            if found:
                cost, p, span = min(found, key=lambda o: (o[0], o[1]))
                key = (cost, -m.bit_count(), i)
                if best is None or key < best[0]:
                    best = (key, (i, p, span))
        return None if best is None else best[1]


def odds(region: int, mix: str, events: Sequence[Event], k: int, futures: int = 2000, horizon: int = 60
         ) -> dict[tuple[int, int], list[int]]:
    """Each (GPU, start) the k-th arrival could take, scored by what row (c) then accepts before its first refusal
    in each of `futures` random continuations of `horizon` events drawn from the trace's own model (ARRIVING, the
    mix's size weights, each departure a VM present at random), the same continuations for every choice: what an
    online placer that knew the model, but not the draw, would weigh."""
    (_, _, size), gpus = before(events, vgpumgr_policy(region), k)
    fast = Masks(region)
    masks = [sum(((1 << s) - 1) << p for p, s, _ in g) for g in gpus]
    live = [(i, ((1 << s) - 1) << p) for i, g in enumerate(gpus) for p, s, _ in g]
    rng = random.Random(f"odds-{region}-{mix}-{k}")
    sizes, weights = SIZES[region], _weights(region, mix)
    draws = [[(rng.random() <= ARRIVING, rng.choices(sizes, weights)[0], rng.random()) for _ in range(horizon)]
             for _ in range(futures)]
    out: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(masks):
        for _, p, span in fast.options(m, size):
            scores = []
            for draw in draws:
                now, present, n = list(masks), [*live, (i, span)], 0
                now[i] |= span
                for arrives, want, pick in draw:
                    if arrives or not present:
                        got = fast.place(now, want)
                        if got is None:
                            break
                        now[got[0]] |= got[2]
                        present.append((got[0], got[2]))
                        n += 1
                    else:
                        gone, freed = present.pop(int(pick * len(present)))
                        now[gone] &= ~freed
                scores.append(n)
            out[i, p] = scores
    return out


def explain(region: int, events: Sequence[Event], first: int, optimum_: int, budget: int, mix: str = "",
            futures: int = 0) -> str:
    need = -(-95 * optimum_ // 100)
    found = decisive(region, events, first, need, budget)
    if found is None:
        return f"not found within the search budget ({need} needed)"
    k, options = found
    (_, _, size), gpus = before(events, vgpumgr_policy(region), k)
    taken = vgpumgr_policy(region)(gpus, size)
    kept = [o for o in options if o[3]]
    cost = next(o[2] for o in options if (o[0], o[1]) == taken)
    line = (f"arrival {k + 1} ({size} GB): (c) takes GPU {taken[0]} at {taken[1]} (cost {cost} GB) and {need} is out "
            f"of reach; {len(kept)} of its {len(options)} (GPU, start) choices keep it reachable, costing "
            + ", ".join(str(o[2]) for o in sorted(kept, key=lambda o: o[2])) + " GB")
    if not futures:
        return line
    scored = odds(region, mix, events, k, futures)
    assert Masks(region).place([sum(((1 << s) - 1) << p for p, s, _ in g) for g in gpus], size)[:2] == taken
    mean = {o: statistics.fmean(v) for o, v in scored.items()}
    rank = sorted(mean.values(), reverse=True).index(mean[taken]) + 1
    best = max(((o[0], o[1]) for o in kept), key=lambda o: mean[o])
    diff = [a - b for a, b in zip(scored[best], scored[taken], strict=True)]
    return (line + f"\n{'':34} {'odds':22} over {futures} continuations of the trace's own model, arrivals accepted "
            f"before (c)'s first refusal: (c)'s choice {mean[taken]:.2f} on average, rank {rank} of {len(mean)}; the "
            f"best that keeps {need} reachable (GPU {best[0]} at {best[1]}) {statistics.fmean(diff):+.2f} +- "
            f"{statistics.stdev(diff) / futures ** 0.5:.2f} against it (paired, one standard error)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--events", type=int, default=240)
    ap.add_argument("--budget", type=int, default=20_000, help="search nodes per proof of (d)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the totals (bench_all)")
    ap.add_argument("--decisive", action="store_true",
                    help="on a trace that misses 5 %% of a proved optimum, name (c)'s choice that decided it")
    ap.add_argument("--odds", type=int, default=0, metavar="N",
                    help="with --decisive: score each choice there by N random continuations of the trace's model")
    args = ap.parse_args()
    t0 = time.monotonic()
    ok = True
    totals: dict[str, list[int]] = {}
    summed_b = summed_c = 0
    print(f"{'trace':34} {'row':22} {'before 1st refusal':>18} {'accepted':>9}")
    for region in (48, 80):
        for mix_name, mix in MIXES.items():
            for seed in range(args.seeds):
                events = trace(region, mix, seed, args.events)
                name = f"{GPUS}x{region}GB {mix_name} #{seed}"
                rows = {"(a) equal-size": replay(events, equal_size(region)),
                        "(b) driver first-free": replay(events, driver_first_free(region)),
                        "(c) vgpumgr policy": replay(events, vgpumgr_policy(region))}
                lo, hi = optimum(region, events, max(first for first, _ in rows.values()), args.budget)
                for row, (first, rate) in rows.items():
                    print(f"{name:34} {row:22} {first:18d} {rate:9.1%}")
                print(f"{name:34} {'(d) offline optimum':22} {str(lo) if lo == hi else f'{lo}-{hi}':>18} {'-':>9}")
                b, c = rows["(b) driver first-free"][0], rows["(c) vgpumgr policy"][0]
                # met only where proved: within 5 % of the bound's upper end; +10 % out of reach when even the
                # upper end is below 1.1 x (b)
                verdicts = {"c>=0.95d": "met" if c >= 0.95 * hi else "unproved" if c >= 0.95 * lo else "MISSED"}
                ok &= all(v == "met" for v in verdicts.values())
                summed_b, summed_c = summed_b + b, summed_c + c
                gain = (c / max(b, 1) - 1) * 100
                print(f"{name:34} {'targets':22} (c)/(b) {gain:+.1f} %, (c)/(d) >= {c / max(hi, 1):.1%}: "
                      + ", ".join(f"{k} {v}" for k, v in verdicts.items()))
                if args.decisive and lo == hi and verdicts["c>=0.95d"] == "MISSED":
                    print(f"{name:34} {'decisive choice':22} "
                          f"{explain(region, events, c, hi, args.budget, mix, args.odds)}")
                sums = totals.setdefault(f"{region}-{mix}", [0, 0, 0, 0, 0, 0])
                for i, v in enumerate((b, c, lo, hi, int(all(v == "met" for v in verdicts.values())),
                                       int(hi < 1.10 * b))):
                    sums[i] += v
    for key, (b, c, lo, hi, met, impossible) in totals.items():
        print(f"{GPUS}x{key.replace('-', 'GB ', 1)} traces: (b) {b}, (c) {c} ({(c / max(b, 1) - 1) * 100:+.1f} %), "
              f"(d) {lo if lo == hi else f'{lo}-{hi}'}; within 5 % of (d) proved on {met} of {args.seeds}"
              + (f"; +10 % over (b) physically impossible on {impossible}" if impossible else ""))
    ok &= summed_c >= summed_b
    verdict = "met" if summed_c >= summed_b else "MISSED"
    print(f"(c) >= (b) summed over every trace: {summed_c} against {summed_b}: {verdict}")
    print(f"bench_mixed: {'all targets met' if ok else 'a target missed'} in {time.monotonic() - t0:.1f} s "
          "((d) 'lo-hi': the optimum lies between, not proved exactly within the search budget)")
    if args.json:
        print(json.dumps({k: {"b": v[0], "c": v[1], "d_lo": v[2], "d_hi": v[3], "traces": args.seeds, "met": v[4],
                              "impossible": v[5]} for k, v in totals.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
