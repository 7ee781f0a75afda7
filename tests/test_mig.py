"""MIG planner over the A100, A30 and H100 profile tables, and MIG-backed vGPU type <-> profile mapping."""

from __future__ import annotations

import mig_reference
import pytest

from vgpumgr.errors import InvalidInput, NoCapacity, NotFound
from vgpumgr.mig import plan as mig

H100 = mig.KNOWN_TABLES["h100-80gb"]
A100_80 = mig.KNOWN_TABLES["a100-80gb"]
A100_40 = mig.KNOWN_TABLES["a100-40gb"]
A30 = mig.KNOWN_TABLES["a30-24gb"]


def layout(table: mig.ProfileTable, *items: tuple[str, int]) -> list[mig.Placed]:
    out = []
    for name, start in items:
        p = table.find(name)
        out.append(mig.Placed(p.id, start, p.size))
    return out


# Full layouts named by compute slices (1g = the single-memory-slice 1g profile), per table.
def full_layouts(t: mig.ProfileTable, one: str, one_double: str, two: str, three: str, four: str, seven: str):
    return {
        "7x1g": [(one, s) for s in range(7)],
        "4g+2g+1g": [(four, 0), (two, 4), (one, 6)],
        "3g+3g": [(three, 0), (three, 4)],
        "3g+2g+1g+1g": [(three, 4), (two, 0), (one, 2), (one, 3)],
        "2g+2g+2g+1g": [(two, 0), (two, 2), (two, 4), (one, 6)],
        "4x1g-double": [(one_double, s) for s in (0, 2, 4, 6)],
        "4g+3g": [(four, 0), (three, 4)],
        "7g": [(seven, 0)],
        "1g+me plus 6x1g": [(one + "+me", 0)] + [(one, s) for s in range(1, 7)],
    }


TABLE_NAMES = {
    "h100": (H100, ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")),
    "a100-80": (A100_80, ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")),
    "a100-40": (A100_40, ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")),
}
CASES = [(gpu, name) for gpu in TABLE_NAMES for name in full_layouts(H100, *TABLE_NAMES["h100"][1])]


@pytest.mark.parametrize(("gpu", "name"), CASES)
def test_every_valid_full_layout_is_accepted(gpu: str, name: str) -> None:
    table, names = TABLE_NAMES[gpu]
    items = full_layouts(table, *names)[name]
    assert mig.layout_problems(table, layout(table, *items)) == []


@pytest.mark.parametrize("gpu", list(TABLE_NAMES))
def test_a_full_layout_leaves_no_room_for_a_1g(gpu: str) -> None:
    table, names = TABLE_NAMES[gpu]
    full = layout(table, *full_layouts(table, *names)["4g+2g+1g"])
    assert mig.best_start(table, full, table.find(names[0])) is None


def test_h100_four_1g20gb_fill_all_memory_slices() -> None:
    full = layout(H100, *[("1g.20gb", s) for s in (0, 2, 4, 6)])
    assert mig.layout_problems(H100, full) == []
    assert sorted(s for gi in full for s in gi.slices) == list(range(8))
    assert mig.placement_problem(H100, full[:3], H100.find("1g.20gb"), 6) is None
    problems = mig.layout_problems(H100, full + layout(H100, ("1g.20gb", 6)))
    assert problems and "overlaps" in problems[0]


def test_a30_layouts() -> None:
    for items in ([("1g.6gb", s) for s in range(4)], [("2g.12gb", 0), ("2g.12gb", 2)],
                  [("2g.12gb", 0), ("1g.6gb", 2), ("1g.6gb", 3)], [("4g.24gb", 0)],
                  [("2g.12gb+me", 0), ("2g.12gb", 2)]):
        assert mig.layout_problems(A30, layout(A30, *items)) == [], items
    assert A30.compute_slices == 4 and A30.memory_slices == 4


@pytest.mark.parametrize(("items", "reason"), [
    ([("3g.40gb", 0), ("3g.40gb", 2)], "cannot start at memory slice 2"),
    ([("4g.40gb", 0), ("3g.40gb", 0)], "overlaps 4g.40gb at slices 0-3"),
    ([("7g.80gb", 0), ("1g.10gb", 6)], "overlaps 7g.80gb"),
    ([("2g.20gb", 1)], "its placements start at 0, 2, 4"),
    ([("1g.10gb+me", 0), ("1g.10gb+me", 1)], "at most 1 instance"),
    ([("1g.10gb", 7)], "cannot start at memory slice 7"),
])
def test_overlapping_or_misplaced_layouts_are_refused_with_a_reason(items, reason: str) -> None:
    problems = mig.layout_problems(H100, layout(H100, *items))
    assert len(problems) == 1
    assert reason in problems[0]


def test_wrong_size_and_unknown_profile_are_reported() -> None:
    p = H100.find("3g.40gb")
    problems = mig.layout_problems(H100, [mig.Placed(p.id, 0, 3), mig.Placed(99, 0, 1)])
    assert problems == ["3g.40gb spans 4 memory slice(s), not 3", "unknown GPU instance profile id 99"]


def test_a30_has_no_slice_4() -> None:
    problems = mig.layout_problems(A30, layout(A30, ("4g.24gb", 0), ("1g.6gb", 3)))
    assert "overlaps" in problems[0]


def test_best_start_keeps_the_largest_profile_possible() -> None:
    # a 3g placed at 4 keeps 4g@0 possible; at 0 only a 3g would remain
    assert mig.best_start(H100, [], H100.find("3g.40gb")) == 4
    # a 1g.20gb goes to the end, where it strands nothing and keeps 4g@0 and 2g@4 possible
    assert mig.best_start(H100, [], H100.find("1g.20gb")) == 6
    # after 4g@0 + 2g@4 the only 1g that is left is 6
    existing = layout(H100, ("4g.40gb", 0), ("2g.20gb", 4))
    assert mig.best_start(H100, existing, H100.find("1g.10gb")) == 6


def test_best_start_never_strands_when_it_can_avoid_it() -> None:
    # 1g at 6 strands slice 7 (nothing of size 1 can start there); any other start does not
    assert mig.stranded_slices(H100, layout(H100, ("1g.10gb", 6))) == {7}
    assert mig.stranded_slices(H100, layout(H100, ("1g.10gb", 0))) == set()
    assert mig.best_start(H100, [], H100.find("1g.10gb")) != 6


def test_greedy_planning_reaches_full_layouts() -> None:
    for table, order in ((H100, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]),
                         (A100_40, ["4g.20gb", "2g.10gb", "1g.5gb"]),
                         (A30, ["2g.12gb", "1g.6gb", "1g.6gb"])):
        existing: list[mig.Placed] = []
        for name in order:
            existing.append(mig.plan(table, existing, table.find(name)))
        assert mig.layout_problems(table, existing) == []
        assert sum(table.by_id(gi.profile_id).compute_slices for gi in existing) == table.compute_slices


def test_plan_and_the_gpu_page_word_no_room_as_placement_does() -> None:
    """One failure, one wording (issue 42): `mig create`'s refusal, the web view's reason and placement's
    (MigFacts.why_none_free) all come from mig.plan.no_room; the old `why_no_room` listed each start's overlap."""
    existing = layout(H100, ("3g.40gb", 0), ("3g.40gb", 4))
    wanted = H100.find("4g.40gb")
    with pytest.raises(NoCapacity) as refused:
        mig.plan(H100, existing, wanted)
    assert refused.value.message == mig.no_room(H100, existing, wanted) \
        == "no room for a 4g.40gb instance (slices 0-3 taken by 3g.40gb)"
    assert not hasattr(mig, "why_no_room")


def test_plan_explains_refusals() -> None:
    existing = layout(H100, ("4g.40gb", 0))
    with pytest.raises(NoCapacity) as full:
        mig.plan(H100, existing + layout(H100, ("3g.40gb", 4)), H100.find("1g.10gb"))
    assert full.value.message == "no room for a 1g.10gb instance (slices 0-6 taken by 4g.40gb, 3g.40gb)"
    with pytest.raises(NoCapacity) as taken:
        mig.plan(H100, existing, H100.find("2g.20gb"), start=2)
    assert "overlaps 4g.40gb" in taken.value.message and taken.value.hint.endswith("4")
    with pytest.raises(InvalidInput) as misplaced:
        mig.plan(H100, [], H100.find("3g.40gb"), start=3)
    assert "cannot start" in misplaced.value.message
    assert mig.plan(H100, existing, H100.find("3g.40gb"), start=4) == mig.Placed(9, 4, 4)


def test_profiles_by_id_or_name() -> None:
    assert H100.find("9").name == "3g.40gb"
    assert H100.find("MIG 1g.10gb+me").id == 20
    with pytest.raises(NotFound):
        H100.find("5g.50gb")
    with pytest.raises(InvalidInput):
        mig.normalise_profile_name("three-g")


H100_TYPES = [f"NVIDIA H100XM-{s}" for s in ("1-10CME", "1-10C", "1-20C", "2-20C", "3-40C", "4-40C", "7-80C")] \
    + ["NVIDIA H100XM-4C"]


@pytest.mark.parametrize(("profile", "type_name"), [
    ("1g.10gb", "NVIDIA H100XM-1-10C"), ("1g.10gb+me", "NVIDIA H100XM-1-10CME"),
    ("1g.20gb", "NVIDIA H100XM-1-20C"), ("3g.40gb", "NVIDIA H100XM-3-40C"), ("MIG 7g.80gb", "NVIDIA H100XM-7-80C"),
])
def test_mig_type_for_profile(profile: str, type_name: str) -> None:
    assert mig.mig_type_for_profile(H100_TYPES, profile) == type_name
    assert mig.profile_for_type(type_name) == mig.normalise_profile_name(profile)


def test_type_objects_and_dicts_are_returned_as_given() -> None:
    types = [{"name": "GRID A100D-2-20C", "id": 700}, {"name": "GRID A100D-20C", "id": 696}]
    assert mig.mig_type_for_profile(types, "2g.20gb") == {"name": "GRID A100D-2-20C", "id": 700}
    assert mig.profile_for_type(types[1]) is None


def test_missing_and_ambiguous_mappings() -> None:
    with pytest.raises(NotFound) as missing:
        mig.mig_type_for_profile(H100_TYPES, "2g.10gb")
    assert "2g.20gb" in missing.value.hint
    both = ["NVIDIA DC-1-24C", "NVIDIA DC-1-24Q"]
    with pytest.raises(InvalidInput):
        mig.mig_type_for_profile(both, "1g.24gb")
    assert mig.mig_type_for_profile(both, "1g.24gb", series="q") == "NVIDIA DC-1-24Q"
    assert mig.profile_for_type("NVIDIA DC-1-24CGFX") == "1g.24gb+gfx"


def _all_layouts(table: mig.ProfileTable) -> list[tuple[mig.Placed, ...]]:
    """Every layout the table allows, each set of GPU instances once (2319 on the 8-slice tables)."""
    found: dict[frozenset[tuple[int, int]], tuple[mig.Placed, ...]] = {}
    stack: list[tuple[mig.Placed, ...]] = [()]
    while stack:
        lay = stack.pop()
        key = frozenset((gi.profile_id, gi.start) for gi in lay)
        if key in found:
            continue
        found[key] = lay
        stack += [(*lay, mig.Placed(p.id, s, p.size)) for p in table.profiles
                  for s in mig_reference.free_starts(table, lay, p)]
    return list(found.values())


@pytest.mark.parametrize("gpu", ["h100-80gb", "a30-24gb"])
def test_planner_agrees_with_the_reference_on_every_layout(gpu: str) -> None:
    """The bit-mask planner with its shared memo answers as the set-based one, layout by layout."""
    table = mig.KNOWN_TABLES[gpu]
    layouts = _all_layouts(table)
    seen: dict[frozenset[tuple[int, int]], int] = {}  # the reference's search memo, shared by this table's checks
    assert len(layouts) == {"h100-80gb": 2319, "a30-24gb": 84}[gpu]
    for n, lay in enumerate(layouts):
        assert mig.stranded_slices(table, lay) == mig_reference.stranded_slices(table, lay), lay
        for p in table.profiles:
            assert mig.free_starts(table, lay, p) == mig_reference.free_starts(table, lay, p), (lay, p.name)
        assert mig.reachable_compute(table, lay) == mig_reference.reachable_compute(table, lay, seen), lay
        if len(lay) <= 1 or n % 29 == 0:  # best_start re-derives what the other checks cover: a spread suffices
            for p in table.profiles:
                assert mig.best_start(table, lay, p) == mig_reference.best_start(table, lay, p, seen), (lay, p.name)
