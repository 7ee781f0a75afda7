#!/usr/bin/env python3
"""Allocate and release vGPUs through the library on a simulated 8-GPU host; print throughput and latency.

Each pair is the full path: host lock, placement, reservation + audit in SQLite, the mdev create
through the simulator's kernel emulator, activation + audit, then removal and release + audit.
Target (issue 4): at least 500 allocate+release pairs per second on SQLite.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--profile", default="t4", help="simulator profile (8 copies of it are built)")
    ap.add_argument("--type", default="T4-4Q")
    ap.add_argument("--hold", type=int, default=16, help="vGPUs kept allocated meanwhile (a busy host)")
    ap.add_argument("--tmp", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                    help="where the simulated tree and the database live (default tmpfs: sysfs is in memory too)")
    args = ap.parse_args()

    from vgpumgr.config import Config
    from vgpumgr.service import Service
    from vgpumgr.sim import profiles

    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        root = profiles.create(Path(tmp) / "host", args.profile, scale=8)
        svc = Service(Config.resolve(sysfs_root=str(root), state_dir=f"{tmp}/state"), licence_mode="off")
        held = [svc.allocate(args.type, vm=f"bg{i}") for i in range(args.hold)]
        for _ in range(10):  # warm caches
            svc.release(svc.allocate(args.type)["uuid"])
        alloc_ms, release_ms = [], []
        t0 = time.perf_counter()
        for _ in range(args.pairs):
            a = time.perf_counter()
            x = svc.allocate(args.type)
            b = time.perf_counter()
            svc.release(x["uuid"] or x["pci_address"])
            c = time.perf_counter()
            alloc_ms.append((b - a) * 1000)
            release_ms.append((c - b) * 1000)
        wall = time.perf_counter() - t0
        for h in held:
            svc.release(h["uuid"] or h["pci_address"])
    pairs_s = args.pairs / wall
    q = statistics.quantiles
    print(f"host: simulated {args.profile} x8 under {args.tmp or 'the temp dir'}, {args.hold} vGPUs held, "
          f"type {args.type}, SQLite")
    print(f"allocate+release pairs: {args.pairs} in {wall:.2f} s = {pairs_s:.0f} pairs/s "
          f"(target >= 500: {'met' if pairs_s >= 500 else 'MISSED'})")
    for name, ms in (("allocate", alloc_ms), ("release", release_ms)):
        p = q(ms, n=100)
        print(f"{name:<9} p50 {statistics.median(ms):6.2f} ms  p99 {p[98]:6.2f} ms  max {max(ms):6.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
