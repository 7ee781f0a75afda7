"""The MIG planner's arithmetic: which starts a profile can take in a layout, searched fast and remembered.

A layout is reduced to what decides every later placement: the occupied memory slices as a bit mask, the
compute slices in use and the instances per profile. `vgpumgr.mig.plan.placement_problem` explains a refusal in
words; these answer the same question (can `profile` start at `start`?) with integer operations, and the
searches over layouts (what is still reachable, which start is best) remember their answers per profile
table: a simulated NVML asks them for every profile on every read. tests/test_mig.py checks every layout of
the known tables against the plain set-based planner (tests/mig_reference.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


# What the search reads of vgpumgr.mig.plan's Profile, Placed and ProfileTable (described here rather than
# imported: mig imports this module).
class Profile(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def compute_slices(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def starts(self) -> tuple[int, ...]: ...
    @property
    def max_instances(self) -> int: ...


class Placed(Protocol):
    @property
    def profile_id(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def size(self) -> int: ...


class ProfileTable(Protocol):
    @property
    def memory_slices(self) -> int: ...
    @property
    def profiles(self) -> tuple[Profile, ...]: ...
    @property
    def compute_slices(self) -> int: ...

State = tuple[int, int, tuple[tuple[int, int], ...]]  # (occupied mask, compute used, (profile id, count)...)


def popcount(mask: int) -> int:
    return bin(mask).count("1")


def span_mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start if size > 0 else 0


def free_starts(index: Index, state: State, profile: Profile) -> list[int]:
    """The starts where placement_problem() finds nothing wrong (same rules, same order of starts)."""
    mask, used, counts = state
    if dict(counts).get(profile.id, 0) >= profile.max_instances:
        return []
    if used + profile.compute_slices > index.compute_slices:
        return []
    return [s for s in profile.starts if not mask & span_mask(s, profile.size)]


class Index:
    """Per profile table: compute budget, compute slices by profile id, and the memoised searches."""

    _tables: dict[ProfileTable, Index] = {}

    def __init__(self, table: ProfileTable) -> None:
        self.table = table
        self.compute_slices = table.compute_slices
        self.compute_of: dict[int, int] = {}
        for p in table.profiles:  # ProfileTable.by_id() answers the first profile with an id
            self.compute_of.setdefault(p.id, p.compute_slices)
        self.all_slices = span_mask(0, table.memory_slices)
        self.reached: dict[State, int] = {}
        self.best: dict[tuple[Any, ...], int | None] = {}

    @classmethod
    def of(cls, table: ProfileTable) -> Index:
        index = cls._tables.get(table)
        if index is None:
            if len(cls._tables) > 64:  # tables come from NVML per GPU model: a handful per process
                cls._tables.clear()
            index = cls._tables[table] = cls(table)
        return index

    def state(self, layout: Sequence[Placed]) -> State:
        mask = used = 0
        counts: dict[int, int] = {}
        for gi in layout:
            mask |= span_mask(gi.start, gi.size)
            used += self.compute_of.get(gi.profile_id, 0)
            counts[gi.profile_id] = counts.get(gi.profile_id, 0) + 1
        return mask, used, tuple(sorted(counts.items()))

    def add(self, state: State, profile: Profile, start: int) -> State:
        mask, used, counts = state
        c = dict(counts)
        c[profile.id] = c.get(profile.id, 0) + 1
        return (mask | span_mask(start, profile.size), used + self.compute_of.get(profile.id, 0),
                tuple(sorted(c.items())))

    def stranded_mask(self, state: State) -> int:
        """Free memory slices no profile can still cover, as a bit mask."""
        free = self.all_slices & ~state[0]
        coverable = 0
        for p in self.table.profiles:
            for s in free_starts(self, state, p):
                coverable |= span_mask(s, p.size)
        return free & ~coverable

    def reachable(self, state: State) -> int:
        """Most compute slices that could still be added to the layout (exhaustive, memoised)."""
        seen = self.reached
        if state in seen:
            return seen[state]
        bound = self.compute_slices - state[1]
        best = 0
        for p in self.table.profiles:
            for s in free_starts(self, state, p):
                best = max(best, p.compute_slices + self.reachable(self.add(state, p, s)))
                if best >= bound:
                    break
            if best >= bound:
                break
        seen[state] = best
        return best
