"""Placement speed on a simulated 8-GPU x 32-VF host (built in code, no sysfs).

Prints allocate+release pairs per second: each allocate is one placement decision followed by
recording the reservation; each release drops a record. Run: .venv/bin/python scripts/bench_placement.py
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from placement_fixtures import HostBuilder  # noqa: E402

from vgpumgr.model import Inventory  # noqa: E402
from vgpumgr.placement.placer import Allocation, Placer, Policy, Request, place  # noqa: E402

TYPES = ["L40S-2Q", "A40-2Q"]


def build_host(gpus: int, vfs: int) -> Inventory:
    b = HostBuilder()
    for n in range(gpus):
        address = f"0000:{0x20 + n * 0x10:02x}:00.0"
        # half L40S on the vendor-VF interface, half A40 with mdev on the VFs; two NUMA nodes
        (b.l40s if n % 2 == 0 else b.a40)(address, numa=n * 2 // gpus, vfs=vfs)
    return b.build()


def run(inv: Inventory, pairs: int, fresh_index: bool, policy: Policy, load: int, seed: int) -> float:
    rng = random.Random(seed)
    px = Placer(inv)
    live: list[Allocation] = []

    def allocate(n: int) -> None:
        req = Request(TYPES[n % len(TYPES)], vm=f"vm{n}")
        d = place(inv, live, req, policy) if fresh_index else px.place(live, req, policy)
        if d.choice is None:
            raise SystemExit(f"no capacity after {len(live)} vGPUs: {d.summary()[:300]}")
        c = d.choice
        live.append(Allocation(c.gpu, c.parent, c.type, 2048, req.vm, c.backend, f"{c.parent}/{n}", c.name))

    for n in range(load):  # background load so the decision sees busy GPUs
        allocate(n)
    start = time.perf_counter()
    for n in range(load, load + pairs):
        allocate(n)
        live.pop(rng.randrange(len(live)))
    return pairs / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--vfs", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--load", type=int, default=96, help="vGPUs that exist before the timed pairs")
    args = ap.parse_args()
    inv = build_host(args.gpus, args.vfs)
    t0 = time.perf_counter()
    for _ in range(20):
        Placer(inv)
    index_ms = (time.perf_counter() - t0) / 20 * 1000
    print(f"host: {args.gpus} GPUs x {args.vfs} VFs, {len(inv.types)} type listings, "
          f"{args.load} vGPUs in place; index build {index_ms:.2f} ms")
    for strategy in ("pack", "spread"):
        for fresh in (False, True):
            rate = run(inv, args.pairs if not fresh else max(args.pairs // 4, 50), fresh, Policy(strategy),
                       args.load, seed=1)
            how = "place() (index per call)" if fresh else "Placer.place (index reused)"
            print(f"{strategy:6s} {how:28s} {rate:8.0f} allocate+release pairs/s")


if __name__ == "__main__":
    main()
