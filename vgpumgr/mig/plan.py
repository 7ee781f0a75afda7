"""MIG planning, pure: where a GPU instance profile can go, and whether a layout is valid and why not.

A GPU instance (GI) occupies memory slices `[start, start+size)`; `start` must be one of its profile's
placements. Compute slices (the `Ng` of a profile name) are a separate budget. No NVML in here: the
NVML layer turns what the driver reports into `Profile`/`Placed` and back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vgpumgr import ids
from vgpumgr.errors import InvalidInput, NoCapacity, NotFound
from vgpumgr.mig.search import Index, popcount
from vgpumgr.mig.search import free_starts as fast_free_starts

_PROFILE_NAME = re.compile(
    r"^(?:MIG\s+)?(?P<slices>[1-8])g\.(?P<gb>[0-9]+)gb(?P<attr>\+me\.all|\+me|-me|\+gfx)?$"
)
# profile-name suffix <-> vGPU type-name attribute: ids.TypeName.mig_profile


@dataclass(frozen=True)
class Profile:
    """One GPU instance profile as the driver reports it (`nvmlDeviceGetGpuInstanceProfileInfo`)."""

    id: int  # profile ID (what create calls take), not the NVML_GPU_INSTANCE_PROFILE_* enum index
    name: str  # 1g.10gb, 1g.10gb+me
    compute_slices: int  # sliceCount
    size: int  # memory slices of every placement
    starts: tuple[int, ...]  # possible placement starts
    max_instances: int  # instanceCount
    memory_mb: int = 0
    enum_index: int | None = None
    multiprocessors: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Profile:
        """From the NVML layer's per-profile dict (see vgpumgr.nvidia.nvml)."""
        placements = d.get("placements") or []
        size = placements[0]["size"] if placements else int(d.get("size") or 0)
        return cls(id=int(d["id"]), name=str(d["name"]), compute_slices=int(d["compute_slices"]), size=size,
                   starts=tuple(int(p["start"]) for p in placements), max_instances=int(d["max_instances"]),
                   memory_mb=int(d.get("memory_mb") or 0), enum_index=d.get("enum_index"),
                   multiprocessors=d.get("multiprocessors"))


@dataclass(frozen=True)
class Placed:
    """An existing or requested GPU instance."""

    profile_id: int
    start: int
    size: int
    id: int | None = None  # GI id once created

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.size)


@dataclass(frozen=True)
class ProfileTable:
    """Everything the planner needs to know about one GPU model."""

    memory_slices: int
    profiles: tuple[Profile, ...]

    @property
    def compute_slices(self) -> int:
        return max((p.compute_slices for p in self.profiles), default=0)

    def by_id(self, profile_id: int) -> Profile | None:
        return next((p for p in self.profiles if p.id == profile_id), None)

    def find(self, wanted: str | int) -> Profile:
        """A profile by ID (`9`), name (`3g.40gb`) or NVIDIA's display name (`MIG 3g.40gb`)."""
        text = str(wanted).strip()
        if text.isdigit():
            found = self.by_id(int(text))
        else:
            key = normalise_profile_name(text)
            found = next((p for p in self.profiles if p.name == key), None)
        if found is None:
            raise NotFound(f"no MIG profile '{wanted}' on this GPU",
                           hint="choose one of: " + ", ".join(f"{p.name} (id {p.id})" for p in self.profiles))
        return found

    @classmethod
    def from_json(cls, profiles: Iterable[dict[str, Any]]) -> ProfileTable:
        parsed = tuple(Profile.from_json(d) for d in profiles)
        return cls(memory_slices=max((max(p.starts, default=0) + p.size for p in parsed), default=0),
                   profiles=parsed)


def normalise_profile_name(text: str) -> str:
    m = _PROFILE_NAME.match(text.strip())
    if not m:
        raise InvalidInput(f"'{text}' is not a MIG profile name",
                           hint="use the form 1g.10gb, 3g.40gb or 1g.10gb+me "
                                "(`vgpumgr mig profiles` lists them)")
    return f"{m['slices']}g.{m['gb']}gb{m['attr'] or ''}"


# -- layout checks ------------------------------------------------------------------------------

def placement_problem(
    table: ProfileTable, existing: Sequence[Placed], profile: Profile, start: int
) -> str | None:
    """Why `profile` cannot be placed at `start` next to `existing`; None when it can."""
    if start not in profile.starts:
        return (f"{profile.name} cannot start at memory slice {start}; "
                f"its placements start at {', '.join(map(str, profile.starts)) or 'none'}")
    wanted = set(range(start, start + profile.size))
    for gi in existing:
        overlap = wanted & set(gi.slices)
        if overlap:
            other = table.by_id(gi.profile_id)
            label = other.name if other else f"profile {gi.profile_id}"
            which = label if gi.id is None else f"{label} (GI {gi.id})"
            return (f"{profile.name} at {start} (slices {_span(start, profile.size)}) overlaps "
                    f"{which} at slices {_span(gi.start, gi.size)}")
    same = sum(1 for gi in existing if gi.profile_id == profile.id)
    if same >= profile.max_instances:
        return f"{profile.name} allows at most {profile.max_instances} instance(s) per GPU"
    used = sum(_compute(table, gi) for gi in existing)
    if used + profile.compute_slices > table.compute_slices:
        return (f"{profile.name} needs {profile.compute_slices} compute slice(s); "
                f"{table.compute_slices - used} of {table.compute_slices} are free")
    return None


def layout_problems(table: ProfileTable, layout: Sequence[Placed]) -> list[str]:
    """Every reason a whole layout is invalid, in order; [] when the driver could create it as given."""
    problems: list[str] = []
    accepted: list[Placed] = []
    for gi in layout:
        profile = table.by_id(gi.profile_id)
        if profile is None:
            problems.append(f"unknown GPU instance profile id {gi.profile_id}")
            continue
        if gi.size != profile.size:
            problems.append(f"{profile.name} spans {profile.size} memory slice(s), not {gi.size}")
            continue
        why = placement_problem(table, accepted, profile, gi.start)
        if why:
            problems.append(why)
        else:
            accepted.append(gi)
    return problems


def free_starts(table: ProfileTable, existing: Sequence[Placed], profile: Profile) -> list[int]:
    return fast_free_starts(Index.of(table), Index.of(table).state(existing), profile)


def best_start(table: ProfileTable, existing: Sequence[Placed], profile: Profile) -> int | None:
    """The placement that strands the fewest memory slices and keeps the most room for what comes next.

    Score, lowest wins: (stranded free slices, -compute slices still reachable, -largest profile still
    placeable, start). None when the profile fits nowhere. Pure, so answers are remembered per table and
    layout (a simulated NVML asks the same question for every profile on every read)."""
    index = Index.of(table)
    state = index.state(existing)
    key = (state, profile.id, profile.size, profile.starts, profile.compute_slices, profile.max_instances)
    if key in index.best:
        return index.best[key]
    scored = []
    for start in fast_free_starts(index, state, profile):
        after = index.add(state, profile, start)
        largest = max((p.compute_slices for p in table.profiles if fast_free_starts(index, after, p)), default=0)
        reachable = index.reachable(after)
        scored.append((popcount(index.stranded_mask(after)), -reachable, -largest, start))
    chosen = index.best[key] = min(scored)[-1] if scored else None
    return chosen


def no_room(table: ProfileTable, existing: Sequence[Placed], profile: Profile, users: Sequence[str] = (),
            unbound: int = 0) -> str | None:
    """Why no GPU instance of `profile` can be made next to `existing`, naming what holds its slices; None
    when one fits. `users`: the VMs whose MIG-backed vGPUs use this GPU's instances; `unbound`: how many of
    its instances hold no vGPU (destroying one frees its slices)."""
    if best_start(table, existing, profile) is not None:
        return None
    wanted = {s for start in profile.starts for s in range(start, start + profile.size)}
    holders = [gi for gi in existing if wanted & set(gi.slices)]
    free_of_overlap = [s for s in profile.starts
                       if not any(set(range(s, s + profile.size)) & set(gi.slices) for gi in existing)]
    if holders and not free_of_overlap:
        taken = sorted(wanted & {s for gi in holders for s in gi.slices})
        why = f"slices {_ranges(taken)} taken by {_instances(table, holders)}"
    else:  # memory is free somewhere: the instance count or the compute slices are what is used up
        why = next((r for r in (placement_problem(table, existing, profile, s) for s in free_of_overlap) if r),
                   "no placements reported")
    if users:
        why += f"; MIG-backed vGPUs of {', '.join(users)}"
    if unbound:
        why += f"; {unbound} GPU instance(s) here hold no vGPU (`vgpumgr mig destroy` frees their slices)"
    return f"no room for a {profile.name} instance ({why})"


def _instances(table: ProfileTable, gis: Sequence[Placed]) -> str:
    """"4g.40gb (GI 1), 3 x 1g.10gb (GIs 2-4)": GPU instances by profile, in the order of their slices."""
    by_profile: dict[int, list[Placed]] = {}
    for gi in sorted(gis, key=lambda g: (g.start, g.id or 0)):
        by_profile.setdefault(gi.profile_id, []).append(gi)
    parts = []
    for pid, group in by_profile.items():
        p = table.by_id(pid)
        name = p.name if p else f"profile {pid}"
        known = [gi.id for gi in group if gi.id is not None]
        label = f" (GI{'s' if len(known) > 1 else ''} {_ranges(known)})" if known else ""
        parts.append(f"{len(group)} x {name}{label}" if len(group) > 1 else f"{name}{label}")
    return ", ".join(parts)


def _ranges(slices: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for s in sorted(slices):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(_span(lo, hi - lo + 1) for lo, hi in runs)


def plan(
    table: ProfileTable, existing: Sequence[Placed], profile: Profile, start: int | None = None
) -> Placed:
    """Check (explicit start) or choose (start None) a placement; raise NoCapacity/InvalidInput with why."""
    if start is None:
        chosen = best_start(table, existing, profile)
        if chosen is None:
            raise NoCapacity(no_room(table, existing, profile) or f"no room for a {profile.name} instance",
                             hint="destroy a GPU instance (`vgpumgr mig list` shows them) "
                                  "or pick a smaller profile")
        return Placed(profile.id, chosen, profile.size)
    why = placement_problem(table, existing, profile, start)
    if why:
        cls = InvalidInput if start not in profile.starts else NoCapacity
        free = free_starts(table, existing, profile)
        raise cls(why, hint=(f"free placements for {profile.name}: {', '.join(map(str, free))}" if free
                             else "destroy a GPU instance first or choose a smaller profile"))
    return Placed(profile.id, start, profile.size)


def stranded_slices(table: ProfileTable, existing: Sequence[Placed]) -> set[int]:
    """Free memory slices that no profile can use any more."""
    index = Index.of(table)
    mask = index.stranded_mask(index.state(existing))
    return {s for s in range(max(table.memory_slices, mask.bit_length())) if mask >> s & 1}


def reachable_compute(table: ProfileTable, existing: Sequence[Placed]) -> int:
    """Most compute slices that could still be added (exhaustive, memoised; at most 8 memory slices)."""
    index = Index.of(table)
    return index.reachable(index.state(existing))


def _compute(table: ProfileTable, gi: Placed) -> int:
    p = table.by_id(gi.profile_id)
    return p.compute_slices if p else 0


def _span(start: int, size: int) -> str:
    return f"{start}" if size == 1 else f"{start}-{start + size - 1}"


# -- MIG-backed vGPU types <-> profiles ---------------------------------------------------------

def _type_name(t: object) -> str:
    if isinstance(t, str):
        return t
    if isinstance(t, dict):
        return str(t.get("name", ""))
    return str(getattr(t, "name", ""))


def profile_for_type(vgpu_type: object) -> str | None:
    """`NVIDIA H100XM-1-10CME` (or a type object/dict so named) -> `1g.10gb+me`; None if not MIG-backed."""
    parsed = ids.parse_type_name(_type_name(vgpu_type))
    return parsed.mig_profile if parsed is not None else None


def mig_type_for_profile(types: Iterable[object], profile_name: str, series: str | None = None) -> object:
    """The MIG-backed vGPU type (item of `types`) for a GI profile such as `1g.10gb`.

    Slices and GB must match, and `+me` <-> `ME`. Raises NotFound, or InvalidInput when several series
    (C and Q, say) match and `series` does not pick one."""
    wanted = normalise_profile_name(profile_name)
    types = list(types)
    candidates = [t for t in types if profile_for_type(t) == wanted]
    if series:
        candidates = [t for t in candidates if ids.parse_type_name(_type_name(t)).series == series.upper()]  # type: ignore[union-attr]
    if not candidates:
        have = sorted({p for p in (profile_for_type(t) for t in types) if p})  # type: ignore[arg-type]
        raise NotFound(f"no MIG-backed vGPU type for profile {wanted}",
                       hint=("MIG-backed types here cover: " + ", ".join(have)) if have
                       else "this GPU offers no MIG-backed vGPU types "
                            "(is MIG mode on and a vGPU host driver loaded?)")
    if len(candidates) > 1:
        raise InvalidInput(f"several vGPU types match profile {wanted}: "
                           + ", ".join(_type_name(t) for t in candidates),
                           hint="pick one by series (C, Q, A or B) or name the vGPU type itself")
    return candidates[0]


# -- known profile tables (sources: docs/sources.md §7) --------------------------------------------
# Used by the simulated NVML and by tests; on hardware always ask NVML. Fields: enum index, name, ID,
# compute slices, placement size, starts, instances, memory MB, SMs.
_ROWS = tuple[tuple[int, str, int, int, int, tuple[int, ...], int, int, int], ...]
_ALL7 = (0, 1, 2, 3, 4, 5, 6)


def _table(memory_slices: int, rows: _ROWS) -> ProfileTable:
    return ProfileTable(memory_slices, tuple(
        Profile(id=pid, name=name, compute_slices=cs, size=size, starts=starts, max_instances=n,
                memory_mb=mb, enum_index=enum, multiprocessors=sm)
        for enum, name, pid, cs, size, starts, n, mb, sm in rows))


KNOWN_TABLES: dict[str, ProfileTable] = {
    # [dev] H100 80GB HBM3 SXM, driver 580.159.04
    "h100-80gb": _table(8, (
        (0, "1g.10gb", 19, 1, 1, _ALL7, 7, 9984, 16),
        (7, "1g.10gb+me", 20, 1, 1, _ALL7, 1, 9984, 16),
        (9, "1g.20gb", 15, 1, 2, (0, 2, 4, 6), 4, 20096, 26),
        (1, "2g.20gb", 14, 2, 2, (0, 2, 4), 3, 20096, 32),
        (2, "3g.40gb", 9, 3, 4, (0, 4), 2, 40448, 60),
        (3, "4g.40gb", 5, 4, 4, (0,), 1, 40448, 64),
        (4, "7g.80gb", 0, 7, 8, (0,), 1, 81152, 132),
    )),
    # [doc] IDs/instances/SMs; MB figures are nominal (GiB x 1024 less reserve), not observed
    "a100-80gb": _table(8, (
        (0, "1g.10gb", 19, 1, 1, _ALL7, 7, 9728, 14),
        (7, "1g.10gb+me", 20, 1, 1, _ALL7, 1, 9728, 14),
        (9, "1g.20gb", 15, 1, 2, (0, 2, 4, 6), 4, 19968, 14),
        (1, "2g.20gb", 14, 2, 2, (0, 2, 4), 3, 19968, 28),
        (2, "3g.40gb", 9, 3, 4, (0, 4), 2, 40192, 42),
        (3, "4g.40gb", 5, 4, 4, (0,), 1, 40192, 56),
        (4, "7g.80gb", 0, 7, 8, (0,), 1, 80384, 98),
    )),
    "a100-40gb": _table(8, (
        (0, "1g.5gb", 19, 1, 1, _ALL7, 7, 4864, 14),
        (7, "1g.5gb+me", 20, 1, 1, _ALL7, 1, 4864, 14),
        (9, "1g.10gb", 15, 1, 2, (0, 2, 4, 6), 4, 9856, 14),
        (1, "2g.10gb", 14, 2, 2, (0, 2, 4), 3, 9856, 28),
        (2, "3g.20gb", 9, 3, 4, (0, 4), 2, 19968, 42),
        (3, "4g.20gb", 5, 4, 4, (0,), 1, 19968, 56),
        (4, "7g.40gb", 0, 7, 8, (0,), 1, 40192, 98),
    )),
    # [doc] A30: 4 memory slices, 4 compute slices
    "a30-24gb": _table(4, (
        (0, "1g.6gb", 14, 1, 1, (0, 1, 2, 3), 4, 5836, 14),
        (7, "1g.6gb+me", 21, 1, 1, (0, 1, 2, 3), 1, 5836, 14),
        (1, "2g.12gb", 5, 2, 2, (0, 2), 2, 11808, 28),
        (8, "2g.12gb+me", 6, 2, 2, (0, 2), 1, 11808, 28),
        (3, "4g.24gb", 0, 4, 4, (0,), 1, 23680, 56),
    )),
    # [doc] RTX PRO 6000 Blackwell (GB202, 96 GB): 4 slices, 1g.24gb x4, 2g.48gb x2, 4g.96gb x1. IDs as on the
    # A30 (the same 4-slice layout), MB and SM figures nominal: the simulator's choice, not observed
    "rtx-pro-6000-96gb": _table(4, (
        (0, "1g.24gb", 14, 1, 1, (0, 1, 2, 3), 4, 24320, 47),
        (1, "2g.48gb", 5, 2, 2, (0, 2), 2, 48640, 94),
        (3, "4g.96gb", 0, 4, 4, (0,), 1, 97280, 188),
    )),
}
