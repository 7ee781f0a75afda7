#!/usr/bin/env python3
"""The fleet at scale: 1,000, 3,000 and 10,000 simulated hosts x 8 GPUs publishing into one PostgreSQL (started
and thrown away by this script), four real services beside them; how long `fleet place`, `fleet capacity`, the
fleet page's first screen and a host's publishing per change take, and how each grows with the hosts.

The simulated hosts are rows written by a load generator through vgpumgr's own publishing code
(vgpumgr.fleet.writes, the statements a host runs; the hosts past the first 300 are copies of their rows made
in SQL, `clone`): each is one of three real simulated boards (8 x T4 on mdev,
8 x L40S on vendor VFs, 8 x A100 in MIG mode), its capacity computed once by vgpumgr.fleet.capacity from that
board's simulated host and then filled to a random level per GPU by the equal-size rule; 1 % are cordoned and
2 % stale (their window is a day: the others stay fresh for the whole run, the stale ones beat two days ago).
While the figures are taken a second process keeps publishing changes of random simulated hosts (`--churn`,
default 20 per second, a heartbeat every 30 s from 1,000 hosts is 33 per second; each change's statement is
timed and printed beside the host's publishing), and the four real services (`python -m api.server`,
tests/fleethosts.py) beat every 2 s.

- place: `Service.fleet_place` (the reads and the pure placer, what `vgpumgr fleet place` and
  GET /v1/fleet/place run), over random types and both policies; and the same through one service's REST socket.
  And `place` for a type every A100 host offers and none has room for (NO_ROOM_TYPE), where it also names the
  fragmented GPU and plans the fleet's compaction; and that plan alone (`fleet compact --for NO_ROOM_TYPE`).
- each read (vgpumgr.fleet.ranked, store, compaction, fragmented) timed apart over one more round of `place`,
  `capacity` and the page (in process): which statement grows with the fleet.
- capacity: `Service.fleet_capacity(type)` over random types, and `fleet_capacity()` (every type).
- page: the web view's fleet page (`GET /ui/fleet`, logged in) from one real service's socket: the first screen,
  unfiltered, by state, and by type.
- publishing: on the host's own path, an in-process Service on a simulated 8 x T4 host in the same database does
  allocate+release pairs; the time inside the publisher per change (the re-read of the touched GPU it triggers
  is placement's anyway), and the pair with publishing on and off, interleaved.
Targets (issues 21 and 41): place p99 <= 50 ms, capacity --type p99 <= 100 ms, publishing p99 <= 2 ms per
change (the time inside the publisher), the fleet page's first screen <= 1 s, all at 10,000 hosts, and each
growing less than linearly with the hosts.

    .venv/bin/python scripts/bench_fleet.py [--scales 1000,3000,10000] [--queries 200] [--pairs 100] [--json]
    .venv/bin/python scripts/bench_fleet.py --only publish --scales 10000 --pairs 200  # publishing alone
    .venv/bin/python scripts/bench_fleet.py --report run.json  # the tables of a run saved with --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
TARGETS = {"place_p99_ms": 50.0, "capacity_p99_ms": 100.0, "publish_p99_ms": 2.0, "page_p99_ms": 1000.0}
BOARDS = (("t4", None), ("l40s-vfio", 16), ("a100-mig", 8))
TYPES = ("T4-4Q", "T4-2B", "T4-16Q", "L40S-4Q", "L40S-12Q", "L40S-48Q", "A100D-1-10C", "A100D-3-40C")


def templates(tmp: Path) -> dict[str, list[Any]]:
    """Each board's 8 GPUs as vgpumgr publishes them, empty."""
    from vgpumgr.config import Config
    from vgpumgr.discovery.inventory import scan
    from vgpumgr.fleet.capacity import host_capacity
    from vgpumgr.nvidia.facts import merge_nvml
    from vgpumgr.placement.placer import Placer
    from vgpumgr.sim import profiles

    out = {}
    for board, vfs in BOARDS:
        root = profiles.create(tmp / f"template-{board}", board, scale=8, vfs=vfs)
        cfg = Config.resolve(sysfs_root=str(root), state_dir=str(tmp / f"template-{board}-state"))
        inv = scan(cfg.host)
        merge_nvml(cfg, inv.gpus, quiet=True)
        out[board] = host_capacity(Placer(inv), [])
    return out


def occupy(gpu: Any, rng: random.Random) -> Any:
    """The GPU with a random number of vGPUs of one random size (NVIDIA's equal-size rule)."""
    sizes = sorted({t.framebuffer_mb for t in gpu.types if t.max})
    if not sizes or rng.random() < 0.3:
        return gpu
    size = rng.choice(sizes)
    limit = min(t.max for t in gpu.types if t.framebuffer_mb == size)
    used = rng.randint(0, limit)
    if used == 0:
        return gpu
    first = next(t.type for t in gpu.types if t.framebuffer_mb == size)
    types = tuple(replace(t, free=(max(0, min(t.free, t.max - used)) if t.framebuffer_mb == size else 0),
                          used=used if t.type == first else 0) for t in gpu.types)
    return replace(gpu, vgpus=used, types=types)


# The simulated hosts do not beat: their window is a day, so those meant to be fresh stay fresh for the whole run
# (with a window of 90 s the first sizes' hosts went stale while the larger ones were measured), and the 2 % meant
# to be stale beat two days ago.
WINDOW_S = 86400.0
STALE_SQL = "now() - interval '2 days'"


def publish_host(s: Any, name: str, gpus: list[Any], first: bool) -> int:
    from vgpumgr.db import store as db_store
    from vgpumgr.fleet import writes

    host_id = db_store.upsert_host(s, name).id
    writes.write_gpus(s, host_id, gpus, prune_types=first)
    writes.write_host(s, host_id, writes.HostFacts(f"https://{name}:8470", f"qemu+ssh://{name}/system",
                                                 "580.159.04", "bench", 30.0, WINDOW_S), len(gpus),
                     sum(g.vgpus for g in gpus))
    return host_id


def grow(url: str, tpl: dict[str, list[Any]], start: int, stop: int, seed: int = 7) -> None:
    """Simulated hosts start..stop-1, each in one transaction, as a host publishes itself."""
    from sqlalchemy import text

    from vgpumgr.db.session import session_factory

    rng = random.Random(seed + start)
    sessions = session_factory(url)
    boards = [b for b, _ in BOARDS]
    for i in range(start, stop):
        board = boards[i % len(boards)]
        with sessions.begin() as s:
            host_id = publish_host(s, f"sim-{i:05d}", [occupy(g, rng) for g in tpl[board]], first=True)
            if i % 100 == 37:  # 1 % cordoned
                s.execute(text("INSERT INTO host_cordons (host_id, reason, cordoned_by, cordoned_at) "
                               "VALUES (:h, 'bench', 'bench', now())"), {"h": host_id})
            if i % 50 == 11:  # 2 % stale: a host that stopped beating an hour ago
                s.execute(text(f"UPDATE fleet_hosts SET heartbeat_at = {STALE_SQL} WHERE host_id = :h"),
                          {"h": host_id})


SEED_HOSTS = 300  # hosts published one by one (random fills); the others are copies of them made in SQL


def clone(url: str, start: int, stop: int) -> None:
    """Simulated hosts start..stop-1 as copies of the first SEED_HOSTS' rows (host i copies host i % SEED_HOSTS),
    made in SQL: ten thousand hosts published one transaction each take most of an hour on a loaded machine. 1 %
    cordoned and 2 % stale as grow() makes them."""
    from sqlalchemy import create_engine, text

    from vgpumgr.db.models import FleetCapacity, FleetGpu, FleetHost, FleetHostType

    def cols(model: Any, skip: str) -> list[str]:
        return [c for c in model.__table__.columns.keys() if c != skip]

    sets = {"a": start, "b": stop, "seed": SEED_HOSTS}
    engine = create_engine(url)
    with engine.begin() as c:
        c.execute(text("INSERT INTO hosts (name, created_at, last_seen) SELECT 'sim-' || lpad(i::text, 5, '0'), "
                       "now(), now() FROM generate_series(:a, :b - 1) i"), sets)
        c.execute(text("CREATE TEMP TABLE m ON COMMIT DROP AS SELECT n.id AS new_id, t.id AS src_id, i, n.name "
                       "FROM generate_series(:a, :b - 1) i JOIN hosts n ON n.name = 'sim-' || lpad(i::text, 5, '0') "
                       "JOIN hosts t ON t.name = 'sim-' || lpad((i % :seed)::text, 5, '0')"), sets)
        h = cols(FleetHost, "host_id")
        c.execute(text(f"INSERT INTO fleet_hosts (host_id, {', '.join(h)}) SELECT m.new_id, "
                       + ", ".join(f"CASE WHEN m.i % 50 = 11 THEN {STALE_SQL} ELSE now() END"
                                   if x == "heartbeat_at" else f"f.{x}" for x in h)
                       + " FROM m JOIN fleet_hosts f ON f.host_id = m.src_id"))
        for model in (FleetGpu, FleetCapacity):
            k = cols(model, "host_id")
            c.execute(text(f"INSERT INTO {model.__tablename__} (host_id, {', '.join(k)}) SELECT m.new_id, "
                           + ", ".join(f"x.{x}" for x in k)
                           + f" FROM m JOIN {model.__tablename__} x ON x.host_id = m.src_id"))
        k = cols(FleetHostType, "host_id")
        c.execute(text(f"INSERT INTO fleet_host_types (host_id, {', '.join(k)}) SELECT m.new_id, "
                       + ", ".join("m.name" if x == "host" else f"x.{x}" for x in k)
                       + " FROM m JOIN fleet_host_types x ON x.host_id = m.src_id"))
        c.execute(text("INSERT INTO host_cordons (host_id, reason, cordoned_by, cordoned_at) "
                       "SELECT new_id, 'bench', 'bench', now() FROM m WHERE i % 100 = 37"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(text("VACUUM ANALYZE"))  # a fleet database in service is autovacuumed: index-only scans as there
    engine.dispose()


def churn(url: str, hosts: int, rate: float, boards: str, log: str | None = None) -> None:
    """`--churn`: publish a change of a random simulated host `rate` times a second until killed (`boards`: the
    parent's board templates, pickled), and sum the host's summary after it, as its follower would; with `log`,
    each change's statement time and its sum's appended to it as a line `MONOTONIC MS SUM_MS` (the parent reads
    the changes made while it measured: `fleet_changes`)."""
    import pickle

    from vgpumgr.db.session import session_factory

    tpl = pickle.loads(Path(boards).read_bytes())
    rng = random.Random(11)
    sessions = session_factory(url)
    names = [b for b, _ in BOARDS]
    from vgpumgr.db import store as db_store
    from vgpumgr.fleet import writes

    out = open(log, "a", buffering=1) if log else None  # noqa: SIM115 - open until the process is killed
    while True:
        t0 = time.monotonic()
        i = rng.randrange(hosts)
        if i % 50 != 11:  # a change of one GPU, as a host's change publishes it (the counts, one statement)
            gpu = occupy(rng.choice(tpl[names[i % len(names)]]), rng)
            with sessions.begin() as s:
                host_id = db_store.upsert_host(s, f"sim-{i:05d}").id
                t = time.perf_counter()
                writes.write_counts(s, host_id, [gpu], 8, gpu.vgpus)
                spent = (time.perf_counter() - t) * 1000
            t = time.perf_counter()
            with sessions.begin() as s:  # the summary summed after the commit (vgpumgr.fleet.follow)
                writes.lock_host(s, host_id)
                writes.refresh_types(s, host_id)
            summed = (time.perf_counter() - t) * 1000
            if out:
                out.write(f"{time.monotonic():.6f} {spent:.4f} {summed:.4f}\n")
        time.sleep(max(0.0, 1 / rate - (time.monotonic() - t0)))


def fleet_changes(log: Path, since: float) -> dict[str, Any] | None:
    """The churn's changes logged since `since` (time.monotonic, one clock for every process on the machine), with
    the sums after them (`summed`)."""
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return None
    spent, summed = [], []
    for line in lines:
        try:
            at, ms, sum_ms = (float(x) for x in line.split(" "))
        except ValueError:  # the last line, half-written when the churn was killed
            continue
        if at >= since:
            spent.append(ms)
            summed.append(sum_ms)
    if not spent:
        return None
    return {**quantiles(spent), "mean": statistics.fmean(spent), "summed": quantiles(summed)}


NO_ROOM_TYPE = "A100D-40C"  # offered by every A100 host, none with room (they are in MIG mode): `place` then
# names the fragmented GPU and plans the fleet's compaction
STATEMENTS = (("vgpumgr.fleet.ranked", ("host_count", "counts", "candidates", "irregular",
                                        "page_counts", "page_hosts", "placeable_free")),
              ("vgpumgr.fleet.store", ("hosts", "offer_groups", "open_gpus", "capacity_by_host", "gpus",
                                       "slot_rows")),
              ("vgpumgr.fleet.compaction", ("full_gpus", "held", "vm_counts")),
              ("vgpumgr.fleet.fragmented", ("roomiest", "rooms", "loads", "vgpus")),
              ("vgpumgr.ops.fleet_compact", ("plan", "_lookup")))


class Statements:
    """Each of the fleet's reads timed while `place`, `capacity` and the page run in this process: which of them
    grows with the fleet."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> Statements:
        import importlib

        for mod_name, names in STATEMENTS:
            mod = importlib.import_module(mod_name)
            for name in names:
                fn = getattr(mod, name)
                self._saved.append((mod, name, fn))
                setattr(mod, name, self._timed(f"{mod_name.rsplit('.', 1)[1]}.{name}", fn))
        return self

    def __exit__(self, *_: Any) -> None:
        for mod, name, fn in self._saved:
            setattr(mod, name, fn)

    def _timed(self, label: str, fn: Any) -> Any:
        def timed_call(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.ms.setdefault(label, []).append((time.perf_counter() - t) * 1000)
        return timed_call

    def medians(self) -> dict[str, dict[str, float]]:
        return {k: {"p50": statistics.median(v), "max": max(v), "n": len(v)} for k, v in sorted(self.ms.items())}


def quantiles(ms: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ms, n=100) if len(ms) > 1 else ms * 99
    # of fewer than 100 figures the 99th percentile is extrapolated past the largest: the largest then
    return {"p50": statistics.median(ms), "p99": min(q[98], max(ms)), "max": max(ms), "n": len(ms)}


def buckets(exposition: str, name: str, **labels: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts in a /metrics text, summed over the series whose labels include
    `labels` (by upper bound)."""
    import re

    sums: dict[float, float] = {}
    for m in re.finditer(rf"^{name}_bucket{{(.*)}} (\S+)$", exposition, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
        if all(got.get(k) == v for k, v in labels.items()):
            le = float(got["le"])
            sums[le] = sums.get(le, 0.0) + float(m[2])
    return sums


def p99_of(sums: dict[float, float]) -> dict[str, float]:
    """What Prometheus's histogram_quantile(0.99, ...) reads from cumulative bucket counts: the observations counted
    and their p99 in ms, interpolated linearly within the bucket it falls in (past the last finite bound: that
    bound)."""
    bounds = sorted(sums)
    total = sums[bounds[-1]] if bounds else 0.0
    if not total:
        return {"n": 0, "p99": float("nan")}
    rank, below, lower = 0.99 * total, 0.0, 0.0
    for le in bounds:
        if sums[le] >= rank:
            if le == float("inf"):
                return {"n": total, "p99": lower * 1000}
            return {"n": total, "p99": (lower + (le - lower) * (rank - below) / max(sums[le] - below, 1e-9)) * 1000}
        below, lower = sums[le], le
    return {"n": total, "p99": lower * 1000}


def p99_between(before: str, after: str, name: str, **labels: str) -> dict[str, float]:
    """p99_of what the histogram counted between two /metrics texts of one service."""
    was = buckets(before, name, **labels)
    return p99_of({le: n - was.get(le, 0.0) for le, n in buckets(after, name, **labels).items()})


def histogram_p99(exposition: str, name: str, **labels: str) -> dict[str, float]:
    """p99_of the histogram `name` in a /metrics text (the series whose labels include `labels`, summed)."""
    return p99_of(buckets(exposition, name, **labels))


def timed(fn: Any, n: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t) * 1000)
    return out


def login(client: Any, token: str) -> None:
    """The web view's session, as a browser gets it: the login form's CSRF field, then the token."""
    import re

    form = client.get("/ui/login").text
    csrf = re.search(r'name="csrf" value="([^"]+)"', form)
    assert csrf, form[:300]
    r = client.post("/ui/login", data={"token": token, "csrf": csrf.group(1), "next": "/ui/"})
    assert r.status_code in (200, 303), r.text[:300]


def host_path(svc_on: Any, svc_off: Any, pairs: int) -> dict[str, Any]:
    """Publishing on a host's own path: time inside the publisher per change, and pairs with it on and off. Each
    pair's vGPU is the first on an empty GPU and then the last to leave it, the costliest change: every one of the
    T4's 17 type rows moves (a 4 GB vGPU leaves no room for the other sizes). Then the same pairs on a GPU that
    already holds one (`publish_held_ms`): only the 4 GB types' 3 rows move, the usual change on a busy host; and
    those pairs again with the whole host marked before each change (`publish_udev_ms`), as `serve` marks it on a
    udev event it cannot trace to one GPU (a PCI device, a driver bound; the simulator has no udev)."""
    from vgpumgr.fleet import publish as pub

    spent: list[float] = []
    held: list[float] = []
    udev: list[float] = []
    into = [spent]
    inner = pub.Publisher.publish

    def measured(self: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(self, *a, **k)
        finally:
            into[0].append((time.perf_counter() - t) * 1000)

    from prometheus_client import generate_latest

    from api.metrics import Metrics

    metrics = Metrics(svc_on)  # the histogram `serve`'s /metrics has, fed by the same publisher
    follower = svc_on.fleet.follower
    follower.settle()
    follower.spent_ms.clear()
    on, off = [], []
    pub.Publisher.publish = measured  # type: ignore[method-assign]
    try:
        for block in range(pairs // 10):
            for svc, sink in ((svc_on, on), (svc_off, off)) if block % 2 else ((svc_off, off), (svc_on, on)):
                for _ in range(10):
                    t = time.perf_counter()
                    svc.release(svc.allocate("T4-4Q")["uuid"])
                    sink.append((time.perf_counter() - t) * 1000)
        exposition = generate_latest(metrics.registry).decode()  # the flips' publishes
        svc_on.fleet.observe = None
        into[0] = []
        kept = svc_on.allocate("T4-4Q")["uuid"]  # pack puts every pair's vGPU beside it
        try:
            for sink, marked in ((held, False), (udev, True)):
                into[0] = sink
                for _ in range(pairs):
                    if marked:
                        svc_on.invalidate()
                    made = svc_on.allocate("T4-4Q")["uuid"]
                    if marked:
                        svc_on.invalidate()
                    svc_on.release(made)
                into[0] = []
        finally:
            svc_on.release(kept)
    finally:
        pub.Publisher.publish = inner  # type: ignore[method-assign]
    follower.settle()
    summed = list(follower.spent_ms)
    from sqlalchemy import text

    floor = []  # a bare statement in a transaction on the same connection pool, under the same load
    with svc_on.reads() as s:
        for _ in range(max(50, pairs * 2)):
            t = time.perf_counter()
            s.execute(text("SELECT 1")).scalar()
            floor.append((time.perf_counter() - t) * 1000)
            time.sleep(0.002)
    return {"publish_ms": quantiles(spent), "publish_mean_ms": statistics.fmean(spent),
            "publish_metric": histogram_p99(exposition, "vgpumgr_fleet_publish_seconds", kind="change"),
            "publish_held_ms": quantiles(held), "publish_held_mean_ms": statistics.fmean(held),
            "publish_udev_ms": quantiles(udev), "publish_udev_mean_ms": statistics.fmean(udev),
            "round_trip_ms": quantiles(floor), "follow_ms": quantiles(summed) if summed else None,
            "pair_ms_on": statistics.median(on), "pair_ms_off": statistics.median(off),
            "added_ms_per_change": (statistics.median(on) - statistics.median(off)) / 2}


def run(scales: list[int], queries: int, pairs: int, churn_rate: float, services: int,
        only: str | None = None) -> dict[str, Any]:
    """Every row at each scale; with `only="publish"`, the fleet built and churned as for every row, but only the
    host's publishing timed."""
    from fleethosts import Fleet
    from pg import PgServer

    from api import tokens
    from vgpumgr.config import Config
    from vgpumgr.db.session import dispose_engines, upgrade
    from vgpumgr.fleet.place import FleetRequest
    from vgpumgr.service import Service
    from vgpumgr.sim import profiles

    pg = PgServer().start()
    fleet = churner = None
    tmp_dir = tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None, prefix="vgpumgr-bench-fleet-")
    tmp = Path(tmp_dir)
    results = []
    try:
        url = pg.create_database("fleet")
        upgrade(url)
        tpl = templates(tmp)
        import pickle

        boards = tmp / "boards.pickle"
        boards.write_bytes(pickle.dumps(tpl))
        os.environ.update(VGPUMGR_HOSTNAME="bench-reader", VGPUMGR_FLEET_PUBLISH="0")
        reader = Service(Config.resolve(sysfs_root=str(profiles.create(tmp / "reader", "t4")),
                                        state_dir=str(tmp / "reader-state"), db=url), licence_mode="off")
        os.environ.update(VGPUMGR_HOSTNAME="bench-host-off")
        host_off = Service(Config.resolve(sysfs_root=str(profiles.create(tmp / "host-off", "t4", scale=8)),
                                          state_dir=str(tmp / "host-off-state"), db=url), licence_mode="off")
        os.environ.update(VGPUMGR_HOSTNAME="bench-host", VGPUMGR_FLEET_PUBLISH="1")
        host_on = Service(Config.resolve(sysfs_root=str(profiles.create(tmp / "host-on", "t4", scale=8)),
                                         state_dir=str(tmp / "host-on-state"), db=url), licence_mode="off")
        host_on.publish_fleet()
        for svc in (host_on, host_off):
            for _ in range(10):  # warm caches
                svc.release(svc.allocate("T4-4Q")["uuid"])
        token = tokens.create_token(reader.cfg, "bench-fleet", "admin")
        fleet = Fleet(tmp / "services", url, token, heartbeat_s=2.0)
        for i, (board, vfs) in enumerate((("t4", None), ("l40s-vfio", 8), ("mixed", 4), ("a100-mig", 4))[:services]):
            fleet.add(f"svc-{i}-{board}", board, vfs=vfs)
        fleet.wait_ready()
        import gc

        gc.collect()
        gc.freeze()  # as `vgpumgr serve` does once it has started (api/server.py): this process reads as it would
        rest = next(iter(fleet.hosts.values()))
        rest.post("/v1/vgpus", {"type": "T4-4Q", "vm": "bench-mover"})
        rng = random.Random(3)
        have = 0
        for n in scales:
            grow(url, tpl, have, min(n, SEED_HOSTS)) if have < SEED_HOSTS else None
            if n > max(have, SEED_HOSTS):
                clone(url, max(have, SEED_HOSTS), n)
            have = n
            if churner is not None:
                churner.terminate()
                churner.wait()
            churn_log = tmp / f"churn-{n}.log"
            churner = subprocess.Popen([sys.executable, __file__, "--churn", url, "--churn-hosts", str(n),
                                        "--churn-rate", str(churn_rate), "--churn-boards", str(boards),
                                        "--churn-log", str(churn_log)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
            measured_from = time.monotonic()
            if only == "publish":
                row = {"hosts": n + services + 1, "simulated_hosts": n, "real_services": services,
                       "load_average": os.getloadavg(), **host_path(host_on, host_off, pairs)}
                row["load_average_after"] = os.getloadavg()
                row["fleet_changes_ms"] = fleet_changes(churn_log, measured_from)
                results.append(row)
                print(f"  {n} simulated hosts: publish mean {row['publish_mean_ms']:.2f} ms, p99 "
                      f"{row['publish_ms']['p99']:.2f} ms", file=sys.stderr)
                continue

            def place(i: int) -> None:
                reader.fleet_place(FleetRequest(rng.choice(TYPES), strategy="spread" if i % 2 else "pack"))

            def capacity(_: int) -> None:
                reader.fleet_capacity(rng.choice(TYPES))

            def rest_place(i: int) -> None:
                r = client.get("/v1/fleet/place", params={"type": rng.choice(TYPES),
                                                          "policy": "spread" if i % 2 else "pack"})
                assert r.status_code == 200, r.text

            def migrate(_: int) -> None:
                reader.fleet_place(FleetRequest("T4-4Q", vm="bench-mover"))

            def no_room(_: int) -> None:
                d = reader.fleet_place(FleetRequest(NO_ROOM_TYPE))
                assert d.choice is None, d.choice

            def capacity_all(_: int) -> None:
                reader.fleet_capacity()

            def page(i: int) -> None:
                params = ({}, {"state": "stale"}, {"type": rng.choice(TYPES)}, {"type": rng.choice(TYPES),
                                                                               "state": "ok", "page": 3})[i % 4]
                r = client.get("/ui/fleet", params=params)
                assert r.status_code == 200 and "fleet-host" in r.text, r.text[:300]

            place(0), capacity(0)  # warm
            with rest.client() as client:  # one client, as a scheduler keeps its connection
                rest_place(0)
                before = client.get("/metrics").text  # what earlier sizes left in the service's histogram
                rest_ms = quantiles(timed(rest_place, max(10, queries // 4)))
                after = client.get("/metrics").text
                name = "vgpumgr_fleet_place_seconds"
                rest_metric = {**p99_between(before, after, name),
                               "errors": p99_between(before, after, name, result="error")["n"]}
                login(client, token)
                page(0)
                page_ms = quantiles(timed(page, max(8, queries // 10)))
            row = {"hosts": n + services + 1, "simulated_hosts": n, "real_services": services,
                   "place_ms": quantiles(timed(place, queries)),
                   "capacity_ms": quantiles(timed(capacity, queries)),
                   "capacity_all_ms": quantiles(timed(capacity_all, max(10, queries // 10))),
                   "rest_place_ms": rest_ms, "rest_place_metric": rest_metric, "page_ms": page_ms,
                   "migrating_place_ms": quantiles(timed(migrate, max(20, queries // 2)))}
            row["no_room_place_ms"] = quantiles(timed(no_room, max(20, queries // 2)))
            row["compact_plan_ms"] = quantiles(timed(lambda _: reader.fleet_compact_plan(NO_ROOM_TYPE), 5))
            with Statements() as st:  # one more round of each, its reads timed apart
                for i in range(2 * len(TYPES)):
                    place(i)
                    capacity(i)
                for i in range(3):
                    no_room(i)
                for i in range(8):
                    reader.fleet_grid(type_name=TYPES[i] if i % 2 else None, state=(None, "ok", "stale", "ok")[i % 4],
                                      page=3 if i % 4 == 3 else 1)
            row["statements"] = st.medians()
            with reader.reads() as s:
                from sqlalchemy import text

                row["gpu_rows"] = s.execute(text("SELECT count(*) FROM fleet_gpus")).scalar()
                row["capacity_rows"] = s.execute(text("SELECT count(*) FROM fleet_capacity")).scalar()
            row.update(host_path(host_on, host_off, pairs))
            row["fleet_changes_ms"] = fleet_changes(churn_log, measured_from)
            results.append(row)
            print(f"  {n} simulated hosts: place p99 {row['place_ms']['p99']:.1f} ms, capacity p99 "
                  f"{row['capacity_ms']['p99']:.1f} ms, publish mean {row['publish_mean_ms']:.2f} ms",
                  file=sys.stderr)
    finally:
        if churner is not None:
            churner.terminate()
            churner.wait()
        if fleet is not None:
            fleet.stop()
        dispose_engines()
        pg.stop()
        import shutil

        shutil.rmtree(tmp_dir, ignore_errors=True)
    return {"scales": results, "targets": TARGETS, "churn_per_s": churn_rate, "gpus_per_host": 8,
            "boards": [b for b, _ in BOARDS], "types": list(TYPES), "only": only}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="1000,3000,10000", help="simulated hosts, comma-separated, growing")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=100, help="allocate+release pairs per scale on the host's path")
    ap.add_argument("--churn-rate", type=float, default=20.0, help="changes published per second meanwhile")
    ap.add_argument("--services", type=int, default=4, help="real services beside the simulated hosts")
    ap.add_argument("--only", choices=("publish",), help="time only this row (the fleet still built and churned)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--report", metavar="FILE", help="print the tables of a run saved with --json")
    ap.add_argument("--churn", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--churn-hosts", type=int, default=10, help=argparse.SUPPRESS)
    ap.add_argument("--churn-boards", help=argparse.SUPPRESS)
    ap.add_argument("--churn-log", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.churn:
        churn(a.churn, a.churn_hosts, a.churn_rate, a.churn_boards, a.churn_log)
        return 0
    if a.report:  # the tables again from a run's --json
        report(json.loads(Path(a.report).read_text()))
        return 0
    r = run([int(x) for x in a.scales.split(",")], a.queries, a.pairs, a.churn_rate, a.services, a.only)
    if a.json:
        print(json.dumps(r))
        return 0
    report(r)
    return 0


def report(r: dict[str, Any]) -> None:
    services = r["scales"][0]["real_services"]
    print(f"hosts: simulated (8 GPUs each: {', '.join(r['boards'])}) + {services} real services + 1 host-path "
          f"service, one PostgreSQL; {r['churn_per_s']:g} changes/s published meanwhile")
    if r.get("only") == "publish":
        report_publish(r)
        return
    head = ["hosts", "GPU rows", "type rows", "place p50/p99", "REST place p99", "migrating p99",
            "capacity --type p50/p99", "capacity p99", "page p50/p99", "publish mean/p99", "pair on/off"]
    rows = [[str(s["hosts"]), str(s["gpu_rows"]), str(s["capacity_rows"]),
             f"{s['place_ms']['p50']:.1f}/{s['place_ms']['p99']:.1f} ms", f"{s['rest_place_ms']['p99']:.1f} ms",
             f"{s['migrating_place_ms']['p99']:.1f} ms",
             f"{s['capacity_ms']['p50']:.1f}/{s['capacity_ms']['p99']:.1f} ms",
             f"{s['capacity_all_ms']['p99']:.0f} ms", f"{s['page_ms']['p50']:.0f}/{s['page_ms']['p99']:.0f} ms",
             f"{s['publish_mean_ms']:.2f}/{s['publish_ms']['p99']:.2f} ms",
             f"{s['pair_ms_on']:.1f}/{s['pair_ms_off']:.1f} ms"] for s in r["scales"]]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    for line in [head, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
    print(f"\n`place` when no host has room ({NO_ROOM_TYPE}: the fragmentation hint and the fleet's compaction "
          "plan), p50/p99: " + ", ".join(f"{s['hosts']} hosts {s['no_room_place_ms']['p50']:.0f}/"
                                        f"{s['no_room_place_ms']['p99']:.0f} ms" for s in r["scales"]))
    print(f"`fleet compact --for {NO_ROOM_TYPE}` (the plan, no budget), p50/max: " + ", ".join(
        f"{s['hosts']} hosts {s['compact_plan_ms']['p50']:.0f}/{s['compact_plan_ms']['max']:.0f} ms"
        for s in r["scales"] if "compact_plan_ms" in s))
    print("\neach read's p50 in ms (place over every type and policy, no-room place, capacity, the page in process):")
    labels = sorted({k for s in r["scales"] for k in s["statements"]})
    width = max(len(x) for x in labels)
    print(" " * width + "".join(f"{s['hosts']:>10}" for s in r["scales"]))
    for k in labels:
        print(k.ljust(width) + "".join(f"{s['statements'][k]['p50']:>10.2f}" if k in s["statements"] else f"{'-':>10}"
                                       for s in r["scales"]))
    first, last = r["scales"][0], r["scales"][-1]
    t = r["targets"]
    for what, value, target in (("place p99", last["place_ms"]["p99"], t["place_p99_ms"]),
                                ("place p99 when no host has room", last["no_room_place_ms"]["p99"], t["place_p99_ms"]),
                                ("place --vm p99 (a VM to move)", last["migrating_place_ms"]["p99"], t["place_p99_ms"]),
                                ("capacity --type p99", last["capacity_ms"]["p99"], t["capacity_p99_ms"]),
                                ("publishing per change p99", last["publish_ms"]["p99"], t["publish_p99_ms"]),
                                ("fleet page first screen p99", last["page_ms"]["p99"], t["page_p99_ms"])):
        print(f"{what} at {last['hosts']} hosts: {value:.2f} ms (target <= {target:g} ms: "
              f"{'met' if value <= target else 'MISSED'})")
    if "round_trip_ms" in last:
        print(_floor(last))
    if "publish_held_ms" in last:
        print(_held(last))
    if last.get("fleet_changes_ms"):
        print(_fleet_changes(last))
    if last.get("follow_ms"):
        print(_follower(last))
    if "rest_place_metric" in last:
        print(_metrics(last))
    hosts = last["hosts"] / first["hosts"]
    for what, key in (("place p50", "place_ms"), ("capacity --type p50", "capacity_ms"), ("page p50", "page_ms"),
                      ("publishing p50", "publish_ms")):
        grew = last[key]["p50"] / first[key]["p50"]
        print(f"{what}: x{grew:.2f} from {first['hosts']} to {last['hosts']} hosts (x{hosts:.1f}): "
              f"{'less than linear' if grew < hosts else 'NOT less than linear'}")


def report_publish(r: dict[str, Any]) -> None:
    """`--only publish`: the time inside the publisher per change, and the pair with publishing on and off."""
    print("hosts  publishes  mean  p50  p99  max (ms)  pair on/off (ms)  load average before / after")
    for s in r["scales"]:
        p = s["publish_ms"]
        print(f"{s['hosts']}  {p['n']}  {s['publish_mean_ms']:.2f}  {p['p50']:.2f}  {p['p99']:.2f}  {p['max']:.2f}"
              f"  {s['pair_ms_on']:.1f}/{s['pair_ms_off']:.1f}  "
              + " / ".join(" ".join(f"{x:.1f}" for x in s[k]) for k in ("load_average", "load_average_after")))
    last = r["scales"][-1]
    value, target = last["publish_ms"]["p99"], r["targets"]["publish_p99_ms"]
    print(f"publishing per change p99 at {last['hosts']} hosts: {value:.2f} ms (target <= {target:g} ms: "
          f"{'met' if value <= target else 'MISSED'})")
    if "round_trip_ms" in last:
        print(_floor(last))
    if "publish_held_ms" in last:
        print(_held(last))
    if last.get("fleet_changes_ms"):
        print(_fleet_changes(last))
    if last.get("follow_ms"):
        print(_follower(last))
    if "publish_metric" in last:
        m = last["publish_metric"]
        print(f"the service's /metrics histogram (vgpumgr_fleet_publish_seconds, kind=change): p99 {m['p99']:.2f} ms "
              f"over {m['n']:.0f} publishes, interpolated within buckets")


def _held(s: dict[str, Any]) -> str:
    h = s["publish_held_ms"]
    line = (f"publishing per change on a GPU that already holds the type (3 of 17 type rows move, the usual change): "
            f"mean {s['publish_held_mean_ms']:.2f} ms, p50 {h['p50']:.2f} ms, p99 {h['p99']:.2f} ms over {h['n']} "
            f"(above: each vGPU the first on its GPU or the last to leave, all 17 rows move)")
    if "publish_udev_ms" in s:
        u = s["publish_udev_ms"]
        line += (f"\nthe same after a udev event marked the whole host (serve marks it on an event it cannot trace to "
                 f"one GPU): mean {s['publish_udev_mean_ms']:.2f} ms, p50 {u['p50']:.2f} ms, p99 {u['p99']:.2f} ms "
                 f"over {u['n']}")
    return line


def _fleet_changes(s: dict[str, Any]) -> str:
    c = s["fleet_changes_ms"]
    line = (f"the fleet's own changes meanwhile (the churn: one GPU of a random simulated host refilled, its change "
            f"statement alone, no capacity computed; not the target's measure): mean {c['mean']:.2f} ms, p50 "
            f"{c['p50']:.2f} ms, p99 {c['p99']:.2f} ms over {c['n']}")
    if "summed" in c:
        summed = c["summed"]
        line += f"; each host's summary summed after it: p50 {summed['p50']:.2f} ms, p99 {summed['p99']:.2f} ms"
    return line


def _follower(s: dict[str, Any]) -> str:
    f = s["follow_ms"]
    return (f"the bench host's summary, summed after its changes' commits (off the change's path, by its follower): "
            f"{f['n']} sums for {s['publish_ms']['n'] + s['publish_held_ms']['n'] + s['publish_udev_ms']['n']} "
            f"changes, p50 {f['p50']:.2f} ms, p99 {f['p99']:.2f} ms")


def _metrics(s: dict[str, Any]) -> str:
    """The same figures as the services' own /metrics histograms give them (histogram_quantile, 0.99)."""
    rest, pub = s["rest_place_metric"], s.get("publish_metric")
    line = (f"the services' /metrics histograms at {s['hosts']} hosts, p99 interpolated within buckets: REST place "
            f"{rest['p99']:.1f} ms over {rest['n']:.0f} answers ({rest['errors']:.0f} errors; measured by the client "
            f"{s['rest_place_ms']['p99']:.1f} ms over {s['rest_place_ms']['n']})")
    if pub:
        line += (f", publish per change {pub['p99']:.2f} ms over {pub['n']:.0f} (measured "
                 f"{s['publish_ms']['p99']:.2f} ms over {s['publish_ms']['n']})")
    return line


def _floor(s: dict[str, Any]) -> str:
    f = s["round_trip_ms"]
    return (f"a bare statement's round trip (SELECT 1) on the publishing service's pool under the same load: p50 "
            f"{f['p50']:.2f} ms, p99 {f['p99']:.2f} ms, max {f['max']:.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
