"""scripts/bench_mixed.py's row (c) is what `vm create` decides: on simulated L40S GPUs in mixed-size mode,
`placement.place` and the benchmark's vgpumgr policy pick the same GPU and placement ID at every arrival of a
seeded trace with departures; and its offline optimum (d) is proved where it says so, by GB, by packing and by
exhaustive search."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

from vgpumgr.discovery.inventory import scan
from vgpumgr.hostfs.root import Host
from vgpumgr.model import BACKEND_NVIDIA_VF
from vgpumgr.placement import placer as placement
from vgpumgr.sim import profiles

_SPEC = importlib.util.spec_from_file_location("bench_mixed",
                                               Path(__file__).parent.parent / "scripts" / "bench_mixed.py")
assert _SPEC and _SPEC.loader
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_bench_policy_row_decides_as_placement_does(tmp_path: Path) -> None:
    root = profiles.create(tmp_path / "sim", "l40s-vfio", scale=3, vfs=32)
    inv = scan(Host(root))
    gpus = sorted(g.address for g in inv.gpus if g.physfn is None and g.vendor_id.endswith("10de"))
    assert len(gpus) == 3
    policy = placement.Policy(mixed_size_gpus=gpus)
    bench_place = bench.vgpumgr_policy(48)
    rng = random.Random(31)
    records: list[placement.Allocation] = []
    state: list[list[tuple[int, int, int]]] = [[] for _ in gpus]
    placed = refused = 0
    for vm in range(60):
        if records and rng.random() < 0.3:
            gone = records.pop(rng.randrange(len(records)))
            for g in state:
                g[:] = [x for x in g if x[2] != int(gone.vm[2:])]
        size = rng.choice(bench.SIZES[48])
        decision = placement.place(inv, records, placement.Request(f"L40S-{size}Q"), policy)
        expected = bench_place([list(g) for g in state], size)
        if decision.choice is None:
            assert expected is None
            refused += 1
            continue
        c = decision.choice
        assert expected == (gpus.index(c.gpu), c.placement_id), f"arrival {vm}: {size} GB"
        records.append(placement.Allocation(c.gpu, c.parent, c.type, size * 1024, f"vm{vm}", BACKEND_NVIDIA_VF,
                                            c.parent, c.name, c.placement_id))
        state[gpus.index(c.gpu)].append((c.placement_id, size, vm))
        state[gpus.index(c.gpu)].sort()
        placed += 1
    assert placed > 20 and refused > 0  # the GPUs filled up: the decisions under pressure were compared too


def test_offline_optimum_is_proved_on_the_issues_example(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(bench, "GPUS", 1)
    # two 2Q, a 24Q, a 16Q (44 GB: the driver's 2Q at 0 and 4 leave the 16Q no start), then an 8Q (52 GB)
    events = [("arrive", 1, 2), ("arrive", 2, 2), ("arrive", 3, 24), ("arrive", 4, 16), ("arrive", 5, 8)]
    assert bench.replay(events, bench.driver_first_free(48))[0] == 3
    assert bench.upper_bound(48, events, 3) == 4  # the fifth needs more GB than the GPU has
    assert bench.optimum(48, events, 3) == (4, 4)  # a placement of the first four exists (2Q at 16 and 18)
    # a departure frees the room: then all five fit
    events.insert(4, ("leave", 3, 0))
    assert bench.optimum(48, events, 3) == (5, 5)


def test_offline_optimum_proves_a_prefix_out_of_reach(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(bench, "GPUS", 1)
    events = [("arrive", 1, 16), ("arrive", 2, 24), ("arrive", 3, 16)]
    assert bench.upper_bound(48, events, 0) == 2  # 16 + 24 + 16 = 56 GB
    events = [("arrive", 1, 24), ("arrive", 2, 12), ("arrive", 3, 12)]  # 48 GB that tile exactly: all three
    assert bench.optimum(48, events, 0) == (3, 3)
    # 44 GB, yet two 16Q (at 0 and 32) overlap every 12Q start (0, 12, 24, 36): proved by packing, not by GB
    events = [("arrive", 1, 16), ("arrive", 2, 16), ("arrive", 3, 12)]
    assert bench.upper_bound(48, events, 0) == 2
    assert bench.optimum(48, events, 0) == (2, 2)
    # history: with a 24Q and a 16Q present the 4Q can only go at 24 or 20; after the 16Q leaves, 8Q + 4Q + 8Q
    # would fit placed afresh (48 GB) but never around that 4Q: only the exhaustive search proves 5
    events = [("arrive", 1, 24), ("arrive", 2, 16), ("arrive", 3, 4), ("leave", 2, 0), ("arrive", 4, 8),
              ("arrive", 5, 4), ("arrive", 6, 8)]
    assert bench.upper_bound(48, events, 0) == 6
    assert bench.optimum(48, events, 0) == (5, 5)
    # played backwards (the VMs present at the end first, departures as arrivals) the answer is the same
    assert bench.backwards(events, 6)[:3] == [("arrive", 1, 24), ("arrive", 4, 8), ("arrive", 6, 8)]
    got, exhaustive = bench.lower_bound(48, bench.backwards(events, 6), 6, 1000)
    assert exhaustive and got < 6
    assert bench.lower_bound(48, bench.backwards(events, 5), 5, 1000) == (5, True)


def test_decisive_choice_is_named(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(bench, "GPUS", 1)
    # two 4Q (the policy: 20, then 12, its cheapest start), the first leaves, then a 16Q, a 24Q and a 4Q: the
    # 4Q at 12 sends the 16Q to 32 and leaves the 24Q no start; only the costlier 24 keeps the first four placeable
    # (16Q at 32, 24Q at 0)
    events = [("arrive", 1, 4), ("arrive", 2, 4), ("leave", 1, 0), ("arrive", 3, 16), ("arrive", 4, 24),
              ("arrive", 5, 4)]
    assert bench.replay(events, bench.vgpumgr_policy(48))[0] == 3
    assert bench.optimum(48, events, 3) == (4, 4)
    arrival, options = bench.decisive(48, events, 3, 4)
    assert arrival == 1
    assert bench.vgpumgr_policy(48)(bench.before(events, bench.vgpumgr_policy(48), 1)[1], 4) == (0, 12)
    assert {(start, cost) for _, start, cost, kept in options if kept} == {(24, 63)}
    assert min(cost for _, _, cost, _ in options) == 35


def test_the_odds_play_row_c_as_the_bench_does() -> None:
    """The odds' fast row (c) on bit masks picks the same GPU and start as vgpumgr_policy at every arrival of a
    trace of each model, up to the first refusal; and `odds` scores every choice of an arrival on the same draws."""
    for region in (48, 80):
        events = bench.trace(region, "large", 0, 240)
        fast = bench.Masks(region)
        compared = 0
        for _, size, gpus, got in bench._arrivals(events, bench.vgpumgr_policy(region)):
            mine = fast.place([sum(((1 << s) - 1) << p for p, s, _ in g) for g in gpus], size)
            assert (mine[:2] if mine else None) == got
            compared += 1
            if got is None:
                break
        assert compared > 60
    scored = bench.odds(48, "large", bench.trace(48, "large", 0, 240), 56, futures=30, horizon=40)
    (_, _, size), gpus = bench.before(bench.trace(48, "large", 0, 240), bench.vgpumgr_policy(48), 56)
    every = {(i, p) for i, g in enumerate(gpus)
             for p in bench.pid.creatable(48, bench.pid.supported(48, size), size, [(a, s) for a, s, _ in g])}
    assert set(scored) == every and all(len(v) == 30 and 0 <= min(v) for v in scored.values())
    assert len({tuple(v) for v in scored.values()}) > 1  # the choices differ in what follows them
