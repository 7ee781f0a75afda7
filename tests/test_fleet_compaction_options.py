"""`fleet compact`'s options (vgpumgr.fleet.compaction.options, pure): every start of the wanted type that at most
--max-moves migrations free, on a GPU in mixed-size mode, not only the one needing the fewest; and a GPU too full
for the type only by what sits in one start's way is a candidate, since the moves free those GB too. The density
bench (scripts/bench_fleet_density.py) plans with the same function."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from vgpumgr.fleet.compaction import EMPTY, PLACEMENT, FullGpu, Held, options
from vgpumgr.placement import ids as pid

GB = 1024
_SPEC = importlib.util.spec_from_file_location("bench_fleet_density",
                                               Path(__file__).parent.parent / "scripts" / "bench_fleet_density.py")
assert _SPEC and _SPEC.loader
fd = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fd)


def _gpu(want_gb: int, vgpus: int, host: str = "host-a", host_id: int = 1) -> FullGpu:
    return FullGpu(host_id, host, "0000:3d:00.0", f"L40S-{want_gb}Q", want_gb * GB, 48 * GB,
                   pid.equal_max(48, want_gb), "mixed", vgpus)


def _held(*vgpus: tuple[str | None, int, int], active: bool = True) -> list[Held]:
    return [Held(vm, f"L40S-{size}Q", active, start, size * GB) for vm, start, size in vgpus]


def test_every_start_within_the_limit_is_an_option_even_on_a_gpu_without_the_gb_free() -> None:
    # 24Q starts at 0 and 24: 0 is held by one 16 GB VM, 24 by two 8 GB VMs; 32 GB in use, so 16 free < 24
    mine = _held(("big", 0, 16), ("s1", 24, 8), ("s2", 40, 8))
    g = _gpu(24, len(mine))
    found = options([g], {(1, g.gpu): mine}, 2)
    assert [(o.how, o.start, o.vms, o.moves, o.gb) for o in found] == [
        (PLACEMENT, 0, ("big",), 1, 16), (PLACEMENT, 24, ("s1", "s2"), 2, 16)]
    # one move at most: only the start whose one VM is in the way
    assert [(o.start, o.vms) for o in options([g], {(1, g.gpu): mine}, 1)] == [(0, ("big",))]
    # the fewest-moves start's VM cannot move (it does not run): the other start is still there
    stuck = _held(("big", 0, 16), active=False) + _held(("s1", 24, 8), ("s2", 40, 8))
    assert [(o.start, o.vms) for o in options([g], {(1, g.gpu): stuck}, 2)] == [(24, ("s1", "s2"))]


def test_options_across_gpus_come_fewest_moves_then_fewest_gb_first() -> None:
    a, b = _gpu(24, 2, "host-a", 1), _gpu(24, 2, "host-b", 2)
    held = {(1, a.gpu): _held(("a1", 0, 4), ("a2", 24, 2)), (2, b.gpu): _held(("b1", 0, 16), ("b2", 32, 16))}
    found = options([a, b], held, 2)
    assert [(o.host, o.start, o.vms, o.gb) for o in found] == [
        ("host-a", 24, ("a2",), 2), ("host-a", 0, ("a1",), 4), ("host-b", 0, ("b1",), 16), ("host-b", 24, ("b2",), 16)]


def test_a_start_held_by_a_vgpu_without_a_vm_is_not_an_option_and_unknown_layouts_empty_the_gpu() -> None:
    g = _gpu(24, 2)
    assert [(o.start, o.vms) for o in options([g], {(1, g.gpu): _held((None, 0, 4), ("x", 24, 24))}, 2)] == [
        (24, ("x",))]
    # a vGPU whose placement ID vgpumgr did not choose: the layout is not known, only emptying the GPU is sure
    unknown = [Held("x", "L40S-4Q", True, None, 4 * GB), Held("y", "L40S-4Q", True, 8, 4 * GB)]
    [o] = options([g], {(1, g.gpu): unknown}, 2)
    assert (o.how, o.vms, o.moves) == (EMPTY, ("x", "y"), 2)


def test_the_density_bench_plans_with_these_options_where_the_fewest_start_alone_finds_no_room() -> None:
    """Host 0's GPU 0 holds a 16 GB and a 4 GB VM in 24 GB start 0 and two 8 GB VMs in start 24; host 1 has
    room for two 8 GB VMs (ID 24 of two GPUs, each 24 GB start there blocked by one 8 GB VM that has nowhere to
    go) and none for 16 GB; every other GPU is full. The 16 GB VM has nowhere to go, the two 8 GB VMs have: the
    plan moves them and the 24 GB arrival takes start 24. Before, the GPU (12 GB free of 24) was not even a
    candidate: only emptying it (four moves) was."""
    full = [(0, 24, 90), (24, 24, 91)]
    fleet = [[[(0, 16, 1), (20, 4, 4), (24, 8, 2), (40, 8, 3)], list(full), list(full), list(full)],
             [[(0, 24, 92), (40, 8, 93)], [(0, 24, 94), (40, 8, 95)], list(full), list(full)]]
    fleet += [[list(full) for _ in range(4)] for _ in range(fd.HOSTS - 2)]
    where = {vm: (h, i) for h, host in enumerate(fleet) for i, g in enumerate(host) for _p, _s, vm in g}
    place = fd.vgpumgr_fleet()
    assert place(fleet, 24, ()) is None
    assert fd.compact(fleet, 24, 1, place, where) is None  # one move: only host 1's starts, whose VMs are stuck
    got = fd.compact(fleet, 24, 2, place, where)
    assert got == ((0, 0, 24), 2)
    assert where[2][0] == 1 and where[3][0] == 1 and fleet[0][0] == [(0, 16, 1), (20, 4, 4)]


def test_max_moves_counts_vms_not_vgpus() -> None:
    # the 24Q start at 24 is held by two 8 GB vGPUs of one VM: one migration frees it
    mine = _held(("big", 0, 16), ("pair", 24, 8), ("pair", 40, 8))
    g = _gpu(24, len(mine))
    assert [(o.start, o.vms, o.moves) for o in options([g], {(1, g.gpu): mine}, 1)] == [
        (0, ("big",), 1), (24, ("pair",), 1)]


def _fleet_with(*gpus: list[tuple[int, int, int]]) -> list:
    """Hosts 0, 1, 2 with the given first GPUs; every other GPU holds two 24 GB VMs (no room for anything)."""
    vm = iter(range(1000, 2000))
    fleet = [[[(0, 24, next(vm)), (24, 24, next(vm))] for _ in range(fd.PER_HOST)] for _ in range(fd.HOSTS)]
    for h, g in enumerate(gpus):
        fleet[h][0] = sorted(g)
    return fleet


def test_the_bench_finds_a_two_move_chain_that_the_planner_does_not_and_proves_when_none_exists() -> None:
    """A 24 GB arrival: host 0's start 0 holds one 16 GB VM (1), which has no free 16 GB start anywhere; host 1's
    16 GB start 0 holds one 8 GB VM (2), and host 2 has a free 8 GB start (40). Moving 2 to host 2 and then 1 to
    host 1 frees host 0's start 0: a chain of two moves, which the planner (each VM placed by `fleet place`)
    misses and `any_plan` (every plan of at most two moves, whatever its destinations) finds. Filling host 2's
    hole and host 0's 8 GB gap leaves no plan of two moves, and `any_plan` says so."""
    small = [(16, 2, 3), (18, 2, 4), (20, 4, 5)]  # host 1's 8-16 GB free, its 24 GB start 0 held by four VMs
    fleet = _fleet_with([(0, 16, 1), (24, 24, 9)], [(0, 8, 2), *small, (24, 24, 10)], [(0, 24, 11), (24, 16, 12)])
    where = {vm: (h, i) for h, host in enumerate(fleet) for i, g in enumerate(host) for _p, _s, vm in g}
    place = fd.vgpumgr_fleet()
    assert place(fleet, 24, ()) is None
    assert fd.any_plan(fleet, 24, 1) is None  # no VM in a start's way alone has a free start elsewhere
    moves, at = fd.any_plan(fleet, 24, 2)
    assert len(moves) == 2 and moves[0][0] == 2 and moves[1][2][:2] == (1, 0)
    for vm, (h, i), (h2, i2, p) in moves:  # the plan is real: applied in order, every move lands on free GB
        size = next(s for _p, s, v in fleet[h][i] if v == vm)
        assert h2 != h and p in pid.creatable(48, pid.supported(48, size), size, fd._taken(fleet[h2][i2]))
        fleet[h][i] = [x for x in fleet[h][i] if x[2] != vm]
        fleet[h2][i2] = sorted([*fleet[h2][i2], (p, size, vm)])
    assert at[2] in pid.creatable(48, pid.supported(48, 24), 24, fd._taken(fleet[at[0]][at[1]]))
    fleet = _fleet_with([(0, 16, 1), (24, 24, 9)], [(0, 8, 2), *small, (24, 24, 10)], [(0, 24, 11), (24, 16, 12)])
    assert fd.compact(fleet, 24, 2, place, where) is None  # the planner's destinations are `fleet place`'s
    full = _fleet_with([(0, 16, 1), (16, 8, 6), (24, 24, 9)], [(0, 8, 2), *small, (24, 24, 10)],
                       [(0, 24, 11), (24, 16, 12), (40, 8, 7)])
    assert fd.any_plan(full, 24, 2) is None


def test_the_bench_counts_the_whole_trace_beside_the_first_refusal() -> None:
    events = [("arrive", v, 24) for v in range(1, 131)] + [
        ("leave", 1, 0), ("arrive", 200, 24)]
    row = fd.replay(events, fd.vgpumgr_fleet())
    # 128 halves of 48 GB: the 129th and 130th are refused, and after a departure the last arrival is accepted
    assert (row.first, row.accepted, row.arrivals, row.moves) == (128, 129, 131, 0)
    fleet, size = row.refused
    assert size == 24 and sum(len(g) for host in fleet for g in host) == 128
