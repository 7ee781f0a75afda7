"""NVIDIA's published mixed-size placement tables (vGPU 17 user guide, appendix B; docs/sources.md §21),
reproduced exactly by the partition algorithm in vgpumgr.placement.ids, and the default policy's choices."""

from __future__ import annotations

import pytest

from vgpumgr.placement import ids as pid

R = range


# (region GB, type GB, equal-size max) -> supported placement IDs, as NVIDIA prints them
PUBLISHED = {
    94: {94: (1, [0]), 47: (2, [0, 47]), 23: (4, [0, 24, 47, 71]), 15: (6, [0, 32, 47, 79]),
         11: (8, [0, 12, 23, 36, 47, 59, 70, 83]), 6: (15, [0, 17, 23, 41, 47, 64, 70, 88]),
         4: (23, [0, 7, 11, 19, 23, 31, 35, 43, 47, 54, 58, 66, 70, 78, 82, 90])},
    80: {80: (1, [0]), 40: (2, [0, 40]), 20: (4, [0, 20, 40, 60]), 16: (5, [0, 24, 40, 64]),
         10: (8, list(R(0, 80, 10))), 8: (10, [0, 12, 20, 32, 40, 52, 60, 72]), 5: (16, list(R(0, 80, 5))),
         4: (20, [0, 6, 10, 16, 20, 26, 30, 36, 40, 46, 50, 56, 60, 66, 70, 76])},
    64: {64: (1, [0]), 32: (2, [0, 32]), 16: (4, [0, 16, 32, 48]), 8: (8, list(R(0, 64, 8))),
         4: (16, list(R(0, 64, 4)))},
    40: {40: (1, [0]), 20: (2, [0, 20]), 10: (4, [0, 10, 20, 30]), 8: (5, [0, 12, 20, 32]),
         5: (8, list(R(0, 40, 5))), 4: (10, [0, 6, 10, 16, 20, 26, 30, 36])},
    32: {s: (32 // s, list(R(0, 32, s))) for s in (32, 16, 8, 4, 2, 1)},
    24: {24: (1, [0]), 12: (2, [0, 12]), 8: (3, [0, 16]), 6: (4, [0, 6, 12, 18]), 4: (6, [0, 8, 12, 20]),
         3: (8, list(R(0, 24, 3))), 2: (12, [0, 4, 6, 10, 12, 16, 18, 22]),
         1: (24, [0, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18, 20, 21, 23])},
    20: {20: (1, [0]), 10: (2, [0, 10]), 5: (4, [0, 5, 10, 15]), 4: (5, [0, 6, 10, 16]),
         2: (10, [0, 3, 5, 8, 10, 13, 15, 18]), 1: (20, [0, 1, 2, 4, 5, 6, 7, 9, 10, 11, 12, 14, 15, 16, 17, 19])},
    16: {16: (1, [0]), 8: (2, [0, 8]), 4: (4, [0, 4, 8, 12]), 2: (8, list(R(0, 16, 2))), 1: (16, list(R(16)))},
}
# the mixed-size maxima NVIDIA prints for the reduced types (max equal -> max mixed)
REDUCED = {(94, 15): 4, (94, 6): 8, (94, 4): 16, (80, 16): 4, (80, 8): 8, (80, 4): 16, (40, 8): 4, (40, 4): 8,
           (24, 8): 2, (24, 4): 4, (24, 2): 8, (24, 1): 16, (20, 4): 4, (20, 2): 8, (20, 1): 16}


@pytest.mark.parametrize("region", sorted(PUBLISHED))
def test_every_published_table_is_reproduced_exactly(region: int) -> None:
    for size, (maxi, ids) in PUBLISHED[region].items():
        for arch in (pid.AMPERE, pid.ADA, pid.HOPPER):
            assert list(pid.supported(region, size, maxi, arch)) == ids, (region, size, arch)
        assert pid.equal_max(region, size) == maxi  # the equal-size maximum the table prints
        assert len(ids) == REDUCED.get((region, size), maxi)


def test_48gb_table_and_the_1gb_deny_lists() -> None:
    derived = {48: [0], 24: [0, 24], 16: [0, 32], 12: [0, 12, 24, 36], 8: [0, 16, 24, 40],
               6: list(R(0, 48, 6)), 4: [0, 8, 12, 20, 24, 32, 36, 44], 3: list(R(0, 48, 3)),
               2: [0, 4, 6, 10, 12, 16, 18, 22, 24, 28, 30, 34, 36, 40, 42, 46]}
    for size, ids in derived.items():
        assert list(pid.supported(48, size, None, pid.ADA)) == ids, size
    assert list(pid.supported(48, 1, 32, pid.ADA)) == [0, 5, 6, 11, 12, 17, 18, 23, 24, 29, 30, 35, 36, 41, 42, 47]
    ampere = pid.supported(48, 1, 32, pid.AMPERE)
    assert len(ampere) == 30 and 8 not in ampere and 32 not in ampere and {2, 3, 9, 33} <= set(ampere)
    # the per-GPU C-series columns: 16C 3->2, 8C 6->4, 4C 12->8
    assert [len(pid.supported(48, s)) for s in (24, 16, 12, 8, 6, 4)] == [2, 2, 4, 4, 8, 8]


def test_blackwell_places_by_even_division() -> None:
    assert pid.supported(96, 24, 4, pid.BLACKWELL) == (0, 24, 48, 72)
    assert pid.supported(96, 16, 6, pid.BLACKWELL) == (0, 16, 32, 48, 64, 80)
    assert pid.placement_size(96, 2, pid.BLACKWELL) == 3
    assert pid.supported(96, 2, 32, pid.BLACKWELL) == tuple(R(0, 96, 3))


def test_creatable_and_blockers_name_the_fragmentation() -> None:
    occupied = [(0, 2), (24, 2)]  # two 2 GB vGPUs at IDs 0 and 24 on a 48 GB GPU
    assert pid.creatable(48, pid.supported(48, 24), 24, occupied) == []
    assert pid.creatable(48, pid.supported(48, 12), 12, occupied) == [12, 36]
    assert pid.blockers((0, 24), 24, [(0, 2, "L40S-2Q of vm7"), (24, 2, "L40S-2Q of vm9")]) == [
        (0, "L40S-2Q of vm7"), (24, "L40S-2Q of vm9")]


def test_default_policy_keeps_the_large_starts_the_driver_gives_away() -> None:
    types = pid.catalogue(48, {f"{s}Q": (s, None) for s in (48, 24, 16, 12, 8, 6, 4, 3, 2)})
    occupied: list[tuple[int, int]] = []
    first = []
    for _ in range(2):
        p = pid.first_free(48, first, pid.supported(48, 2), 2)
        first.append((p, 2))
    assert first == [(0, 2), (4, 2)]  # the driver: both 2Q in the first 24 GB half ...
    for _ in range(2):
        p, _cost = pid.choose(48, types, occupied, pid.supported(48, 2), 2)
        occupied.append((p, 2))
    # ... vgpumgr: both 2Q where they cost neither 16Q start (0, 32) nor a second 12Q start
    assert all(16 <= p < 32 for p, _ in occupied)
    assert pid.creatable(48, pid.supported(48, 16), 16, occupied) == [0, 32]
    assert pid.choose(48, types, [(0, 48)], pid.supported(48, 2), 2) is None


def test_pack_chooses_gpu_and_start_together_by_what_they_give_away() -> None:
    types = pid.catalogue(48, {f"{s}Q": (s, None) for s in (48, 24, 16, 12, 8, 6, 4, 3, 2, 1)})
    fuller = [(0, 24)]  # one 24Q: the other half is still a whole 24Q start
    fragmented = [(0, 2), (24, 2)]  # the example: no 24Q start left anyway
    two = pid.supported(48, 2)
    on_fuller = pid.choose(48, types, fuller, two, 2)
    on_fragmented = pid.choose(48, types, fragmented, two, 2)
    assert on_fuller is not None and on_fragmented is not None
    assert on_fuller[1] >= 24  # a 2Q on the fuller GPU takes its last 24Q start
    assert on_fragmented[1] < on_fuller[1]
    shares = {"fuller": 24 / 48, "fragmented": 4 / 48}
    ranked = sorted([("fuller", on_fuller), ("fragmented", on_fragmented)],
                    key=lambda c: pid.pack_order(c[1][1], shares[c[0]]))
    assert ranked[0][0] == "fragmented"  # not the fullest GPU: it would give a 24Q away
    assert pid.creatable(48, pid.supported(48, 24), 24, fuller) == [24]
    # the same cost on one GPU: the fullest wins
    assert pid.pack_order(0, 0.5) < pid.pack_order(0, 0.25)


def test_cost_counts_what_still_fits_not_starts() -> None:
    types = pid.catalogue(48, {"24Q": (24, None), "2Q": (2, None)})
    # the first 2Q anywhere in a half takes one 24Q (24 GB) and the 2Q's own slot (2 GB), whatever the start
    assert pid.cost(48, types, [], 0, 2) == 24 + 2
    assert pid.cost(48, types, [], 22, 2) == 24 + 2
    assert pid.max_count(48, pid.supported(48, 2), 2, pid.free_mask(48, [(0, 24)])) == 8


def test_equal_size_ids_step_by_the_placement_size_and_other_sizes_are_cleared() -> None:
    assert pid.homogeneous_slots(48, 12, 4) == (12, (0, 12, 24, 36))
    # a 96 GB Blackwell's 2 GB type takes 3 GB slots: its equal-size IDs are j * 3, within the region
    size, ids = pid.homogeneous_slots(96, 2, 32, pid.BLACKWELL)
    assert size == 3 and ids == tuple(range(0, 96, 3)) and ids[-1] + size <= 96
    assert pid.creatable_in_mode(48, (0, 12, 24, 36), 12, [(0, 12)], equal=True) == [12, 24, 36]
    assert pid.creatable_in_mode(48, (0, 8, 16, 24, 32, 40), 8, [(0, 12)], equal=True) == []  # another size
    assert pid.creatable_in_mode(48, (0, 8, 16, 24, 32, 40), 8, [(0, 12)], equal=False) == [16, 24, 32, 40]
