#!/usr/bin/env python3
"""Allocate and release vGPUs through the library on a simulated 8-GPU host; print throughput and latency.

Each pair is the full path: host lock, placement, reservation + audit, the mdev create through the
simulator's kernel emulator, activation + audit, then removal and release + audit. The database is SQLite
(default) or a PostgreSQL server this script starts and throws away (`--db postgresql`, tests/pg.py: unix
socket, fsync off as on tmpfs). Besides time it counts SQL statements and transactions per pair (engine
events), which do not depend on how loaded the machine is.
Targets (issue 13): >= 500 allocate+release pairs/s on SQLite, >= 300 on PostgreSQL.

    .venv/bin/python scripts/bench_allocate.py [--db sqlite|postgresql] [--pairs 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"sqlite": 500, "postgresql": 300}


PHASES = (  # (module, attribute, label): wall time inside each, per pair (`--breakdown`)
    ("vgpumgr.sim.kernel", "KernelEmulator.write", "simulated kernel: sysfs writes (create, remove)"),
    ("vgpumgr.backends.mdev", "get", "mdev lookups around the writes"),
    ("vgpumgr.ops.context", "Context.snapshot", "host snapshot: re-read of the touched GPU, placer index"),
    ("vgpumgr.placement.placer", "Placer.place", "placement decision"),
    ("vgpumgr.ops.allocate", "live_records", "live records query"),
    ("vgpumgr.ops.leases", "check_dead", "dead-owner check"),
    ("vgpumgr.audit.chain", "record", "audit appends (3 per pair: hash, head UPDATE, event INSERT)"),
)


class Phases:
    """Wall time spent inside a few functions (wrapped for the run; nested phases are not subtracted)."""

    def __init__(self) -> None:
        import functools
        import importlib

        self.spent: dict[str, float] = dict.fromkeys((p[2] for p in PHASES), 0.0)
        for module, attr, label in PHASES:
            owner: Any = importlib.import_module(module)
            *path, name = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            inner = getattr(owner, name)

            def timed(*a: Any, _inner: Any = inner, _label: str = label, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return _inner(*a, **k)
                finally:
                    self.spent[_label] += time.perf_counter() - t

            setattr(owner, name, functools.wraps(inner)(timed))

    def reset(self) -> None:
        for k in self.spent:
            self.spent[k] = 0.0


class Counter:
    """SQL statements and commits seen by one engine, with the prepared writes that bypass its events."""

    def __init__(self, engine: Any) -> None:
        from sqlalchemy import event

        from vgpumgr.db import prepared

        self._prepared = prepared
        self._prepared_before = prepared.executed
        self.engine_statements = self.commits = 0
        event.listen(engine, "before_cursor_execute", self._stmt)
        event.listen(engine, "commit", self._commit)

    def _stmt(self, *_: Any) -> None:
        self.engine_statements += 1

    @property
    def statements(self) -> int:
        return self.engine_statements + self._prepared.executed - self._prepared_before

    def _commit(self, *_: Any) -> None:
        self.commits += 1


def run(db: str, pairs: int, profile: str, type_name: str, hold: int, tmp_dir: str | None,
        breakdown: bool = False) -> dict[str, Any]:
    from vgpumgr.config import Config
    from vgpumgr.db.session import dispose_engines, get_engine
    from vgpumgr.service import Service
    from vgpumgr.sim import profiles

    phases = Phases() if breakdown else None
    pg = None
    with tempfile.TemporaryDirectory(dir=tmp_dir) as tmp:
        try:
            url = None
            if db == "postgresql":
                sys.path.insert(0, str(REPO))
                from tests.pg import PgServer

                pg = PgServer().start()
                url = pg.create_database("bench")
            root = profiles.create(Path(tmp) / "host", profile, scale=8)
            cfg = Config.resolve(sysfs_root=str(root), state_dir=f"{tmp}/state", db=url)
            svc = Service(cfg, licence_mode="off")
            held = [svc.allocate(type_name, vm=f"bg{i}") for i in range(hold)]
            for _ in range(10):  # warm caches
                svc.release(svc.allocate(type_name)["uuid"])
            counter = Counter(get_engine(cfg.db_url))
            if phases:
                phases.reset()
            alloc_ms, release_ms = [], []
            t0 = time.perf_counter()
            for _ in range(pairs):
                a = time.perf_counter()
                x = svc.allocate(type_name)
                b = time.perf_counter()
                svc.release(x["uuid"] or x["pci_address"])
                c = time.perf_counter()
                alloc_ms.append((b - a) * 1000)
                release_ms.append((c - b) * 1000)
            wall = time.perf_counter() - t0
            for h in held:
                svc.release(h["uuid"] or h["pci_address"])
            dispose_engines()
        finally:
            if pg is not None:
                pg.stop()
    q = statistics.quantiles
    return {
        "db": db, "pairs": pairs, "seconds": wall, "pairs_per_s": pairs / wall, "target": TARGETS[db],
        "statements_per_pair": counter.statements / pairs, "commits_per_pair": counter.commits / pairs,
        "allocate_ms": {"p50": statistics.median(alloc_ms), "p99": q(alloc_ms, n=100)[98], "max": max(alloc_ms)},
        "release_ms": {"p50": statistics.median(release_ms), "p99": q(release_ms, n=100)[98],
                       "max": max(release_ms)},
        "host": f"simulated {profile} x8, {hold} vGPUs held, type {type_name}",
        "breakdown_ms_per_pair": {k: v * 1000 / pairs for k, v in phases.spent.items()} if phases else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", choices=sorted(TARGETS), default="sqlite")
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--profile", default="t4", help="simulator profile (8 copies of it are built)")
    ap.add_argument("--type", default="T4-4Q")
    ap.add_argument("--hold", type=int, default=16, help="vGPUs kept allocated meanwhile (a busy host)")
    ap.add_argument("--tmp", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                    help="where the simulated tree and the database live (default tmpfs: sysfs is in memory too)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    ap.add_argument("--breakdown", action="store_true", help="also the wall time per pair inside each phase")
    args = ap.parse_args()
    r = run(args.db, args.pairs, args.profile, args.type, args.hold, args.tmp, args.breakdown)
    if args.json:
        print(json.dumps(r))
        return 0
    met = "met" if r["pairs_per_s"] >= r["target"] else "MISSED"
    print(f"host: {r['host']}, {args.db} under {args.tmp or 'the temp dir'}")
    print(f"allocate+release pairs: {r['pairs']} in {r['seconds']:.2f} s = {r['pairs_per_s']:.0f} pairs/s "
          f"(target >= {r['target']}: {met})")
    print(f"per pair: {r['statements_per_pair']:.1f} SQL statements, {r['commits_per_pair']:.1f} commits")
    for name in ("allocate", "release"):
        ms = r[f"{name}_ms"]
        print(f"{name:<9} p50 {ms['p50']:6.2f} ms  p99 {ms['p99']:6.2f} ms  max {ms['max']:6.2f} ms")
    if r["breakdown_ms_per_pair"]:
        total = 1000 / r["pairs_per_s"]
        print(f"where a pair's {total:.2f} ms go (the rest: sessions, statements not listed, lock, Python):")
        for label, ms_ in r["breakdown_ms_per_pair"].items():
            print(f"  {ms_:6.3f} ms  {ms_ / total:5.1%}  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
