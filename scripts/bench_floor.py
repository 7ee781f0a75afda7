#!/usr/bin/env python3
"""What an allocate+release pair cannot cost less than here: its parts measured one by one, each at its floor.

On the same simulated host and SQLite database as `bench_allocate.py` (8 x T4, 16 vGPUs held, T4-4Q):
- kernel: one mdev create + remove through the simulator's emulator alone (Host.write), no vgpumgr logic;
- database at the driver: the pair's four transactions and eleven statements (the same SQL text, tables
  and indexes; three audit hashes) run on the sqlite3 connection with nothing above it;
- database through SQLAlchemy Core: the same statements through `Connection.execute` in `engine.begin()`,
  the layer the issue keeps (what its per-statement and per-transaction cost adds), and as vgpumgr runs
  them (Core transactions and reads, the writes prepared: vgpumgr.db.prepared);
- the snapshot re-read of the touched GPU with the placer's index, and one placement decision;
- the full pair through the library, measured in the same run.

    .venv/bin/python scripts/bench_floor.py [--pairs 500] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # vgpumgr, and tests.pg for --db postgresql

TARGETS = {"sqlite": 500, "postgresql": 300}  # pairs/s (issue 13)


def per_call_ms(fn: Callable[[], Any], n: int) -> float:
    for _ in range(max(5, n // 20)):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) * 1000 / n


def _reserve_values(host_id: int, uuid: str) -> dict[str, Any]:
    from vgpumgr.db.models import utcnow
    from vgpumgr.db.store import NO_OWNER

    return {"host_id": host_id, "backend": "mdev", "parent": "0000:3b:00.0", "type_id": "nvidia-223", "uuid": uuid,
            "pci_address": None, "gpu_id": None, "vm_id": None, "lease_id": None, "type_name": "GRID T4-4Q",
            "series": "Q", "idempotency_key": None, "detail": {"framebuffer_mb": 4096, "gpu": "0000:3b:00.0"},
            "state": "reserved", "created_at": utcnow(), "activated_at": None, "released_at": None,
            **NO_OWNER, "owner_host": "bench", "owner_pid": 1, "owner_boot": "b" * 32, "owner_started": 1.0}


class DbPair:
    """The pair's database work with the SQL of vgpumgr's own statements, run through `execute`."""

    def __init__(self, engine: Any, host_id: int, through_core: bool, prepared_writes: bool = False) -> None:
        from vgpumgr.audit import chain as audit
        from vgpumgr.db import store

        self.engine, self.host_id, self.core = engine, host_id, through_core
        self.prepared_writes = prepared_writes  # with Core: the writes as vgpumgr runs them (db.prepared)
        self.audit, self.store = audit, store
        from sqlalchemy import select

        from vgpumgr.db.models import AuditHead

        with engine.connect() as c:
            self.seq, self.hash = c.execute(select(AuditHead.seq, AuditHead.hash)).one()
        self.raw = engine.raw_connection()
        self.driver = self.raw.driver_connection
        self.conn = engine.connect() if through_core else None
        d = engine.dialect
        self.pg = d.name == "postgresql"
        # SELECTs rendered once, IN lists expanded, for the driver run
        self.selects = {}
        for name, stmt in (("live", store._LIVE_ROWS), ("by_uuid", store._LIVE_BY["uuid"])):
            expanded = stmt.compile(dialect=d).construct_expanded_state({"host_id": 0, "ref": ""})
            self.selects[name] = (stmt, expanded.statement, expanded.positiontup, expanded.parameters)

    def _select(self, name: str, params: dict[str, Any]) -> list[Any]:
        stmt, sql, order, defaults = self.selects[name]
        if self.core:
            return list(self.conn.execute(stmt, params))
        values = defaults | params
        cur = self.driver.cursor()
        cur.execute(sql, values if order is None else [values[k] for k in order])
        return cur.fetchall()

    def _write(self, prepared: Any, params: dict[str, Any]) -> Any:
        if self.core and self.prepared_writes:
            return prepared.execute(self.conn, params)
        if self.core:
            return self.conn.execute(prepared.stmt, params)
        return prepared.execute(_DriverConn(self.engine.dialect, self.raw), params)

    def _event(self, action: str, vgpu: str) -> None:
        from vgpumgr.db.models import utcnow

        values = {"at": utcnow(), "host": "bench", "actor": "bench", "action": action, "outcome": "ok",
                  "gpu": "0000:3b:00.0", "vm": None, "vgpu": vgpu, "error": None, "detail": {"type": "nvidia-223"}}
        self.audit._link(values, self.seq, self.hash)
        moved = {"seq": values["seq"], "hash": values["hash"], "old_seq": self.seq, "old_hash": self.hash}
        if self.pg:  # one statement there, as vgpumgr.audit.chain does
            self._write(self.audit._ADVANCE_AND_APPEND, values | moved)
        else:
            self._write(self.audit._ADVANCE_HEAD, moved)
            self._write(self.audit._APPEND_EVENT, values)
        self.seq, self.hash = values["seq"], values["hash"]

    def _begin(self, write: bool) -> None:
        if self.core:
            self._tx = self.conn.begin()
        elif not self.pg:  # psycopg2 begins by itself on the first statement
            self.driver.execute("BEGIN IMMEDIATE" if write else "BEGIN")

    def _end(self, commit: bool) -> None:
        if self.core:
            self._tx.commit() if commit else self._tx.rollback()
        elif self.pg:
            self.driver.commit() if commit else self.driver.rollback()
        else:
            self.driver.execute("COMMIT" if commit else "ROLLBACK")

    def pair(self) -> None:
        from vgpumgr import ids
        from vgpumgr.db.models import utcnow

        uuid = ids.new_uuid()
        self._begin(True)  # place: live rows, reserve, audit
        self._select("live", {"host_id": self.host_id})
        row = self._write(self.store._RESERVE[self.engine.dialect.name], _reserve_values(self.host_id, uuid))
        aid = row.scalar() if self.core and not self.prepared_writes else row.fetchone()[0]
        self._event("placement", uuid)
        self._end(True)
        self._begin(True)  # activate, audit
        self._write(self.store._ACTIVATE_DONE, {"aid": aid, "at": utcnow()})
        self._event("vgpu.create", uuid)
        self._end(True)
        self._begin(False)  # the release's lookup
        self._select("by_uuid", {"host_id": self.host_id, "ref": uuid})
        self._end(False)
        self._begin(True)  # release, audit
        self._write(self.store._RELEASE, {"aid": aid, "at": utcnow()})
        self._event("vgpu.remove", uuid)
        self._end(True)


class _DriverConn:
    """What `Prepared.execute` needs of a Connection, over a bare pooled DBAPI connection."""

    def __init__(self, dialect: Any, raw: Any) -> None:
        self.dialect, self.connection = dialect, raw


def measure(pairs: int, db: str = "sqlite") -> dict[str, Any]:
    from bench_allocate import run as run_pairs  # the script beside this one (its folder is on sys.path)

    from vgpumgr.config import Config
    from vgpumgr.db.session import dispose_engines, get_engine
    from vgpumgr.ops.allocate import live_records
    from vgpumgr.placement.placer import Policy, Request
    from vgpumgr.service import Service
    from vgpumgr.sim import profiles

    out: dict[str, float] = {}
    tmp_dir = "/dev/shm" if Path("/dev/shm").is_dir() else None
    pg = None
    with tempfile.TemporaryDirectory(dir=tmp_dir) as tmp:
        url = None
        if db == "postgresql":
            from tests.pg import PgServer

            pg = PgServer().start()
            url = pg.create_database("floor")
        root = profiles.create(Path(tmp) / "host", "t4", scale=8)
        cfg = Config.resolve(sysfs_root=str(root), state_dir=f"{tmp}/state", db=url)
        svc = Service(cfg, licence_mode="off")
        for i in range(16):
            svc.allocate("T4-4Q", vm=f"bg{i}")
        x = svc.allocate("T4-4Q")
        parent, gpu, type_id = x["parent"], x["gpu"], x["type"]
        svc.release(x["uuid"])
        host = svc.host

        def kernel_pair() -> None:
            from vgpumgr import ids

            uuid = ids.new_uuid()
            host.write(host.mdev_type(parent, type_id) / "create", uuid)
            host.write(host.mdev(uuid) / "remove", "1")

        out["kernel"] = per_call_ms(kernel_pair, pairs)
        engine = get_engine(cfg.db_url)
        with svc.reads() as s:
            host_id = svc.host_id(s)
            records = live_records(svc, s)
        for label, core, prep in (("db_driver", False, False), ("db_core", True, False),
                                  ("db_prepared", True, True)):
            work = DbPair(engine, host_id, through_core=core, prepared_writes=prep)
            out[label] = per_call_ms(work.pair, pairs)
            if work.conn is not None:
                work.conn.close()
            work.raw.close()

        def resnap() -> None:
            svc.touch(gpu, parent)
            svc.snapshot()

        out["snapshot"] = per_call_ms(resnap, pairs)
        out["placement"] = per_call_ms(lambda: svc.snapshot().placer.place(records, Request("T4-4Q", None),
                                                                           Policy()), pairs)
        dispose_engines()
        if pg is not None:
            pg.stop()
    full = run_pairs(db, pairs, "t4", "T4-4Q", 16, tmp_dir)
    out["pair"] = 1000 / full["pairs_per_s"]
    return {"db": db, "ms_per_pair": out, "pairs": pairs, "target_ms": 1000 / TARGETS[db],
            "statements_per_pair": full["statements_per_pair"]}


LABELS = {
    "kernel": "simulated kernel alone: mdev create + remove (Host.write)",
    "db_driver": "database at the driver: 4 transactions, the pair's statements, 3 audit hashes",
    "db_core": "the same through SQLAlchemy Core (Connection.execute, engine.begin)",
    "db_prepared": "the same as vgpumgr runs it: Core transactions and reads, prepared writes",
    "snapshot": "re-read of the touched GPU + the placer's index",
    "placement": "one placement decision",
    "pair": "the full pair through the library (bench_allocate, same run)",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=500)
    ap.add_argument("--db", choices=sorted(TARGETS), default="sqlite",
                    help="postgresql: a throwaway server started by the script (tests/pg.py)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = measure(args.pairs, args.db)
    if args.json:
        print(json.dumps(r))
        return 0
    ms = r["ms_per_pair"]
    print(f"{args.db}: target {TARGETS[args.db]} pairs/s = {r['target_ms']:.2f} ms per pair")
    for k, label in LABELS.items():
        print(f"  {ms[k]:6.3f} ms  {label}")
    floor = ms["kernel"] + ms["db_driver"] + ms["placement"]
    print(f"  {floor:6.3f} ms  floor: kernel + database at the driver + placement "
          f"(= {1000 / floor:.0f} pairs/s at most, with nothing else done)")
    reread = ms["kernel"] + ms["db_driver"] + ms["snapshot"] + ms["placement"]
    print(f"  {reread:6.3f} ms  the same with the re-read of the touched GPU (= {1000 / reread:.0f} pairs/s at most)")
    kept = ms["kernel"] + ms["db_prepared"] + ms["snapshot"] + ms["placement"]
    print(f"  {kept:6.3f} ms  with SQLAlchemy kept: kernel + database as run + re-read + placement "
          f"(= {1000 / kept:.0f} pairs/s at most)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
