"""The MIG planner as first written: set arithmetic and a search per call, with no shared memo.

vgpumgr.mig.plan answers the same questions with bit masks and remembers answers per table;
tests/test_mig.py checks both agree on every layout the known tables allow. Kept as the readable
statement of the rules, not used by vgpumgr itself."""

from __future__ import annotations

from collections.abc import Sequence

from vgpumgr.mig.plan import Placed, Profile, ProfileTable


def _compute(table: ProfileTable, gi: Placed) -> int:
    p = table.by_id(gi.profile_id)
    return p.compute_slices if p else 0


def fits(table: ProfileTable, existing: Sequence[Placed], profile: Profile, start: int) -> bool:
    if start not in profile.starts:
        return False
    wanted = set(range(start, start + profile.size))
    if any(wanted & set(gi.slices) for gi in existing):
        return False
    if sum(1 for gi in existing if gi.profile_id == profile.id) >= profile.max_instances:
        return False
    used = sum(_compute(table, gi) for gi in existing)
    return used + profile.compute_slices <= table.compute_slices


def free_starts(table: ProfileTable, existing: Sequence[Placed], profile: Profile) -> list[int]:
    return [s for s in profile.starts if fits(table, existing, profile, s)]


def stranded_slices(table: ProfileTable, existing: Sequence[Placed]) -> set[int]:
    used = {s for gi in existing for s in gi.slices}
    free = set(range(table.memory_slices)) - used
    coverable: set[int] = set()
    for p in table.profiles:
        for s in free_starts(table, existing, p):
            coverable.update(range(s, s + p.size))
    return free - coverable


def reachable_compute(table: ProfileTable, existing: Sequence[Placed],
                      seen: dict[frozenset[tuple[int, int]], int] | None = None) -> int:
    seen = {} if seen is None else seen  # one search's memo: a layout's answer depends on the layout only

    def search(layout: list[Placed]) -> int:
        key = frozenset((gi.profile_id, gi.start) for gi in layout)
        if key not in seen:
            seen[key] = max((p.compute_slices + search([*layout, Placed(p.id, s, p.size)])
                             for p in table.profiles for s in free_starts(table, layout, p)), default=0)
        return seen[key]

    return search(list(existing))


def best_start(table: ProfileTable, existing: Sequence[Placed], profile: Profile,
               seen: dict[frozenset[tuple[int, int]], int] | None = None) -> int | None:
    """`seen`: a memo of searched layouts of this table, kept by the caller across calls."""
    scored, seen = [], {} if seen is None else seen
    for start in free_starts(table, existing, profile):
        after = [*existing, Placed(profile.id, start, profile.size)]
        largest = max((p.compute_slices for p in table.profiles if free_starts(table, after, p)), default=0)
        scored.append((len(stranded_slices(table, after)), -reachable_compute(table, after, seen), -largest, start))
    return min(scored)[-1] if scored else None
