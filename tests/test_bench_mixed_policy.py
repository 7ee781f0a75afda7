"""scripts/bench_mixed.py's row (c) is what `vm create` decides: on simulated L40S GPUs in mixed-size mode,
`placement.place` and the benchmark's vgpumgr policy pick the same GPU and placement ID at every arrival of a
seeded trace with departures."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

from vgpumgr import placement
from vgpumgr.host import Host
from vgpumgr.inventory import scan
from vgpumgr.model import BACKEND_NVIDIA_VF
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
