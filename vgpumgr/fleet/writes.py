"""The fleet's rows as a host writes them when it publishes (vgpumgr.fleet.publish), and a load generator that
speaks the same (scripts/bench_fleet.py).

Time stamps come from the database server's clock on PostgreSQL (`now()`), so hosts whose clocks disagree still
agree on whose heartbeat is old; SQLite serves one machine and uses its clock.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import Any

from sqlalchemy import delete, func, tuple_, update
from sqlalchemy.orm import Session

from vgpumgr.db import prepared
from vgpumgr.db.models import FleetCapacity, FleetGpu, FleetHost, utcnow
from vgpumgr.db.prepared import pg_ints, pg_texts
from vgpumgr.fleet.capacity import GpuCapacity
from vgpumgr.fleet.store import ROOM


def _pg(s: Session) -> bool:
    return s.get_bind().dialect.name == "postgresql"


def _now(s: Session) -> Any:
    return func.now() if _pg(s) else utcnow()


# -- writes (the publishing host) ------------------------------------------------------------------------------
# A host writes these after every change it makes, so they run at the driver, as db/prepared.py's statements do:
# one statement per table whatever the number of rows (arrays through unnest on PostgreSQL, executemany on
# SQLite); a row that did not change is not rewritten (PostgreSQL then writes no new row version for it).

_GPU_COLS = ("model", "vendor_id", "device_id", "subsystem_vendor_id", "subsystem_device_id", "driver", "mode",
             "numa_node", "vgpus", "region_mb", "used_mb")
_CAP_COLS = ("name", "short", "backend", "framebuffer_mb", "model", "device_id", "free", "used", "max")
_HOST_COLS = ("endpoint", "migration_uri", "driver_version", "version", "heartbeat_s", "stale_after_s", "gpus",
              "vgpus")


def _set(cols: Sequence[str], table: str) -> tuple[str, str]:
    changed = " OR ".join(f"{table}.{c} IS DISTINCT FROM excluded.{c}" for c in cols)
    return ", ".join(f"{c} = excluded.{c}" for c in cols), changed


def _sqlite_set(cols: Sequence[str], table: str) -> tuple[str, str]:
    return ", ".join(f"{c} = excluded.{c}" for c in cols), " OR ".join(
        f"{table}.{c} IS NOT excluded.{c}" for c in cols)


def _pg_gpus_sql() -> str:
    sets, _ = _set((*_GPU_COLS, "published_at", "room_at"), "g")
    return ("INSERT INTO fleet_gpus AS g (host_id, address, " + ", ".join(_GPU_COLS) + ", published_at, room_at) "
            "SELECT %(h)s, t.*, now(), now() FROM unnest(%(address)s::varchar[], %(model)s::varchar[], "
            "%(vendor_id)s::varchar[], %(device_id)s::varchar[], %(subsystem_vendor_id)s::varchar[], "
            "%(subsystem_device_id)s::varchar[], "
            "%(driver)s::varchar[], %(mode)s::varchar[], %(numa_node)s::int[], %(vgpus)s::int[], %(region_mb)s::int[], "
            "%(used_mb)s::int[]) AS t "
            f"ON CONFLICT (host_id, address) DO UPDATE SET {sets}")


def _pg_capacity_sql() -> str:
    sets, changed = _set(_CAP_COLS, "c")
    return ("INSERT INTO fleet_capacity AS c (host_id, gpu, type_id, " + ", ".join(_CAP_COLS) + ") "
            "SELECT %(h)s, t.* FROM unnest(%(gpu)s::varchar[], %(type_id)s::varchar[], %(name)s::varchar[], "
            "%(short)s::varchar[], %(backend)s::varchar[], %(framebuffer_mb)s::int[], %(model)s::varchar[], "
            "%(device_id)s::varchar[], %(free)s::int[], "
            "%(used)s::int[], %(max)s::int[]) AS t "
            f"ON CONFLICT (host_id, gpu, type_id) DO UPDATE SET {sets} WHERE {changed}")


def _sqlite_gpus_sql() -> str:
    sets, _ = _sqlite_set((*_GPU_COLS, "published_at", "room_at"), "fleet_gpus")
    cols = ("host_id", "address", *_GPU_COLS, "published_at", "room_at")
    return (f"INSERT INTO fleet_gpus ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
            f"ON CONFLICT (host_id, address) DO UPDATE SET {sets}")


def _sqlite_capacity_sql() -> str:
    sets, changed = _sqlite_set(_CAP_COLS, "fleet_capacity")
    cols = ("host_id", "gpu", "type_id", *_CAP_COLS)
    return (f"INSERT INTO fleet_capacity ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
            f"ON CONFLICT (host_id, gpu, type_id) DO UPDATE SET {sets} WHERE {changed}")


def _host_sql(pg: bool) -> str:
    cols = ("host_id", *_HOST_COLS, "heartbeat_at", "generation", "types_generation", "fit_generation")
    if pg:
        values = ", ".join(f"%({c})s" for c in cols[:-4]) + ", now(), 1, 1, 1"
        target = "h"
    else:
        values = ", ".join("?" * (len(cols) - 3)) + ", 1, 1, 1"
        target = "fleet_hosts"
    sets = ", ".join(f"{c} = excluded.{c}" for c in (*_HOST_COLS, "heartbeat_at"))
    return (f"INSERT INTO fleet_hosts{' AS h' if pg else ''} ({', '.join(cols)}) VALUES ({values}) ON CONFLICT "
            f"(host_id) DO UPDATE SET {sets}, generation = {target}.generation + 1, {_KEEP_TYPES.format(t=target)}, "
            f"{_KEEP_FIT.format(t=target)}" + (" RETURNING types_generation IS NOT NULL AND fit_generation IS NOT NULL"
                                               if pg else ""))


# fleet_host_types rows stay true for the host's generation only while every publish keeps them: one that wrote
# them (refresh_types) or moved them with the counts (_PG_COUNTS) carries the mark on. A change leaves them behind
# (_PG_CHANGE; vgpumgr.fleet.follow sums them afresh after it), as an older release's publish does (it moves
# `generation` alone, or, the previous one, carries types_generation on without moving tightest_mb): the host's
# summary (or its best fit) is then not trusted, and its rows are read, until it is summed afresh
_KEEP_TYPES = ("types_generation = CASE WHEN {t}.types_generation = {t}.generation THEN {t}.generation + 1 "
               "END")
_KEEP_FIT = "fit_generation = CASE WHEN {t}.fit_generation = {t}.generation THEN {t}.generation + 1 END"

# A host's summary per type from its own rows (fleet.store.HostType)
# (after the rows themselves were written); `tightest_mb`: of the GPUs with a free instance, the least room
_TIGHTEST = f"min(CASE WHEN c.free > 0 THEN {ROOM} END)"
_SUMMARY_SELECT = (
    "SELECT c.short, min(n.name), min(c.name), min(c.model), min(c.device_id), min(c.framebuffer_mb), "
    "count(DISTINCT c.model || '/' || c.device_id), count(*), sum(CASE WHEN c.free > 0 THEN 1 ELSE 0 END), "
    f"sum(c.free), sum(c.used), sum(coalesce(c.max, 0)), {_TIGHTEST} FROM fleet_capacity c "
    "JOIN hosts n ON n.id = c.host_id JOIN fleet_gpus g ON g.host_id = c.host_id AND g.address = c.gpu "
    "WHERE c.host_id = {h} GROUP BY c.short")
_TYPE_COLS = ("host", "name", "model", "device_id", "framebuffer_mb", "boards", "gpus", "open_gpus", "free", "used",
              "max", "tightest_mb")


def _types_sql(pg: bool) -> tuple[str, ...]:
    h = "%(h)s" if pg else ":h"
    table = "t" if pg else "fleet_host_types"
    changed = " OR ".join(f"{table}.{c} IS {'DISTINCT FROM' if pg else 'NOT'} excluded.{c}" for c in _TYPE_COLS)
    upsert = (f"INSERT INTO fleet_host_types{' AS t' if pg else ''} (host_id, short, {', '.join(_TYPE_COLS)}) "
              f"SELECT {h}, s.* FROM ({_SUMMARY_SELECT.format(h=h)}) AS s {'' if pg else 'WHERE true '}"
              f"ON CONFLICT (host_id, short) DO UPDATE SET "
              + ", ".join(f"{c} = excluded.{c}" for c in _TYPE_COLS) + f" WHERE {changed}")
    gone = (f"DELETE FROM fleet_host_types WHERE host_id = {h} AND short NOT IN "
            f"(SELECT short FROM fleet_capacity WHERE host_id = {h})")
    mark = f"UPDATE fleet_hosts SET types_generation = generation, fit_generation = generation WHERE host_id = {h}"
    if pg:
        return (f"WITH gone AS ({gone} RETURNING 1), kept AS ({upsert} RETURNING 1) {mark}",)
    return gone, upsert, mark


# 0x76677075 ("vgpu"): the advisory lock space of a host's publishes (lock_host)
_PUBLISH_LOCK = "SELECT pg_advisory_xact_lock(1986490485, %(h)s)"
_TRY_LOCK = "SELECT pg_try_advisory_xact_lock(1986490485, %(h)s)"

# A change of a GPU this process already published moves only counts: its type rows' free, used and max, the GPU's
# vGPUs, mode and room (region_mb, used_mb: summed from the same type rows in Python, GpuCapacity; room_at =
# published_at says they are this release's, a previous one moves published_at alone), the host's heartbeat. On
# PostgreSQL that is one statement of plain UPDATEs; a row missing there is healed by the next full publish. Every
# type row of the touched GPUs is written, moved or not: their counts are in no index, so each new version stays
# on its page (fillfactor 70), which cost less than locking each row to compare it first (~0.1 ms a change).
# It takes the host's publish lock (lock_host) first, in the same round trip: every part reads its rows through
# `l`, which takes the lock, so no row is locked or written before it is held. The statement's snapshot is older
# than the lock (a publish that held it may have committed meanwhile): a row that publish wrote is written again
# all the same (READ COMMITTED updates its newest version), so this change's values are what stays.
_PG_NEW = (f"WITH l AS MATERIALIZED ({_PUBLISH_LOCK}), "
           "v AS (SELECT v.* FROM l, unnest(%(gpu)s::varchar[], %(type_id)s::varchar[], "
           "%(free)s::int[], %(used)s::int[], %(max)s::int[]) AS v(gpu, type_id, free, used, max)), ")
_PG_GPUS = (
    "u AS (SELECT u.* FROM l, unnest(%(address)s::varchar[], %(vgpus)s::int[], %(mode)s::varchar[], "
    "%(region_mb)s::int[], %(used_mb)s::int[]) AS u(address, vgpus, mode, region_mb, used_mb)), {between}"
    "g AS (UPDATE fleet_gpus g SET vgpus = u.vgpus, mode = u.mode, region_mb = u.region_mb, used_mb = u.used_mb, "
    "published_at = now(), room_at = now() FROM u WHERE g.host_id = %(h)s AND g.address = u.address RETURNING 1) ")
# The change leaves the host's summary (fleet_host_types) behind: the host row moves one generation on and its
# marks (types_generation, fit_generation) stay, so every reader takes the host from its own rows until the
# summary is summed afresh after the commit (vgpumgr.fleet.follow). Moving the summary here was most of a change's
# time and all of its tail: a first vGPU on a T4 rewrote 17 rows with five index entries each.
_PG_CHANGE = (
    _PG_NEW + "c AS (UPDATE fleet_capacity c SET free = v.free, used = v.used, max = v.max FROM v WHERE c.host_id = "
    "%(h)s AND c.gpu = v.gpu AND c.type_id = v.type_id RETURNING 1), " + _PG_GPUS.format(between="")
    + "UPDATE fleet_hosts SET heartbeat_at = now(), generation = fleet_hosts.generation + 1, gpus = %(gpus)s, "
    "vgpus = %(total)s FROM l WHERE host_id = %(h)s")
# Inside a full publish (its lock taken by a statement of its own, so this statement's snapshot is newer than the
# lock), a GPU whose type set is unchanged moves the summary with its counts: by what its touched rows moved
# (their values before, locked, against after), and each type's tightest GPU afresh, the touched GPUs' from the
# change itself (it carries every type row of each, as write_counts is only called for GPUs whose type rows this
# process wrote), the others as the snapshot has them. The host row is written after it (write_host).
_PG_COUNTS = (
    _PG_NEW + "o AS (SELECT c.gpu, c.type_id, c.short, c.free AS was_free, c.used AS was_used, c.max AS was_max, "
    "v.free, v.used, v.max FROM fleet_capacity c JOIN v ON c.gpu = v.gpu AND c.type_id = v.type_id WHERE "
    "c.host_id = %(h)s FOR UPDATE OF c), "
    "m AS (SELECT * FROM o WHERE (was_free, was_used, was_max) IS DISTINCT FROM (free, used, max)), "
    "c AS (UPDATE fleet_capacity c SET free = m.free, used = m.used, max = m.max FROM m WHERE c.host_id = %(h)s "
    "AND c.gpu = m.gpu AND c.type_id = m.type_id RETURNING 1), "
    "d AS (SELECT short, sum(CASE WHEN free > 0 THEN 1 ELSE 0 END - CASE WHEN was_free > 0 THEN 1 ELSE 0 END) AS "
    "open_gpus, sum(free - was_free) AS free, sum(used - was_used) AS used, "
    "sum(coalesce(max, 0) - coalesce(was_max, 0)) AS max FROM m GROUP BY short), " + _PG_GPUS.format(between=(
        "f AS (SELECT a.short, min(a.room) FILTER (WHERE a.free > 0) AS tightest_mb FROM (SELECT x.short, x.free, "
        f"{ROOM} AS room FROM fleet_gpus g JOIN fleet_capacity x ON x.host_id = g.host_id AND x.gpu = g.address "
        "WHERE g.host_id = %(h)s AND NOT g.address = ANY(%(address)s::varchar[]) UNION ALL SELECT o.short, o.free, "
        "u.region_mb - u.used_mb FROM o JOIN u ON u.address = o.gpu) AS a GROUP BY a.short), "
        "t AS (UPDATE fleet_host_types t SET open_gpus = t.open_gpus + coalesce(d.open_gpus, 0), free = t.free + "
        "coalesce(d.free, 0), used = t.used + coalesce(d.used, 0), max = t.max + coalesce(d.max, 0), tightest_mb = "
        "f.tightest_mb FROM f LEFT JOIN d ON d.short = f.short WHERE t.host_id = %(h)s AND t.short = f.short AND "
        "((d.short IS NOT NULL AND (d.open_gpus, d.free, d.used, d.max) <> (0, 0, 0, 0)) OR t.tightest_mb IS "
        "DISTINCT FROM f.tightest_mb) RETURNING 1), ")) + "SELECT true")
_SQLITE_CHANGE = (
    "UPDATE fleet_capacity SET free = ?, used = ?, max = ? WHERE host_id = ? AND gpu = ? AND type_id = ? AND "
    "(free IS NOT ? OR used IS NOT ? OR max IS NOT ?)",
    "UPDATE fleet_gpus SET vgpus = ?, mode = ?, region_mb = ?, used_mb = ?, published_at = ?, room_at = ? "
    "WHERE host_id = ? AND address = ?",
    "UPDATE fleet_hosts SET heartbeat_at = ?, generation = generation + 1, " + _KEEP_TYPES.format(t="fleet_hosts")
    + ", " + _KEEP_FIT.format(t="fleet_hosts") + ", gpus = ?, vgpus = ? WHERE host_id = ?")

_SQL = {"postgresql": {"gpus": _pg_gpus_sql(), "capacity": _pg_capacity_sql(), "host": _host_sql(True),
                       "change": _PG_CHANGE, "counts": _PG_COUNTS, "types": _types_sql(True)[0]},
        "sqlite": {"gpus": _sqlite_gpus_sql(), "capacity": _sqlite_capacity_sql(), "host": _host_sql(False),
                   "change-capacity": _SQLITE_CHANGE[0], "change-gpus": _SQLITE_CHANGE[1],
                   "change-host": _SQLITE_CHANGE[2]}}


def _server_prepared(name: str, sql: str) -> tuple[str, str, tuple[str, ...]]:
    """(PREPARE statement, EXECUTE statement, parameter order) of a statement with %(name)s parameters: the
    change statement is planned once per connection, not at every change (~0.3 ms of its ~0.6 ms here)."""
    order: list[str] = []
    types: list[str] = []

    def number(m: re.Match[str]) -> str:
        key, cast = m.group(1), m.group(2) or ""
        if key not in order:
            order.append(key)
            types.append(cast.lstrip(":") or "int")
        return f"${order.index(key) + 1}{cast}"

    body = re.sub(r"%\((\w+)\)s(::[\w\[\]]+)?", number, sql)
    prepare = f"PREPARE vgpumgr_{name} ({', '.join(types)}) AS {body}"
    execute = f"EXECUTE vgpumgr_{name} ({', '.join(f'%({k})s' for k in order)})"
    return prepare, execute, tuple(order)


_PREPARED = {name: _server_prepared(name, _SQL["postgresql"][name]) for name in ("change", "counts")}


def _sqlite_now() -> str:
    return utcnow().astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")  # as SQLAlchemy stores a DateTime there


_SQLITE_TYPES = _types_sql(False)


def _run_sql(s: Session, sql: str, params: Any) -> None:
    _run(s, "", params, sql=sql)


def _run(s: Session, name: str, params: Any, many: bool = False, sql: str | None = None, fetch: bool = False
         ) -> Any:
    """One of the statements above on the session's own connection (its transaction), at the driver; with
    `fetch`, its first row's first value (None: no row)."""
    conn = s.connection()
    sql = sql or _SQL[conn.dialect.name][name]
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        if name in _PREPARED and conn.dialect.driver == "psycopg":
            cursor.execute(sql, params, prepare=True)  # psycopg 3 prepares on the server itself, per connection
        elif name in _PREPARED and conn.dialect.name == "postgresql":
            prepare, sql, _ = _PREPARED[name]
            info = conn.connection.info  # lives as long as the server connection (a new one prepares again)
            if not info.get(prepare):
                cursor.execute(prepare)
                info[prepare] = True
            cursor.execute(sql, params)
        elif many:
            cursor.executemany(sql, params)
        else:
            cursor.execute(sql, params)
        row = cursor.fetchone() if fetch else None
    except Exception as exc:
        conn._handle_dbapi_exception(exc, sql, params, cursor, None)  # SQLAlchemy's errors, as Connection.execute
        raise
    finally:
        cursor.close()
    prepared.executed += 1  # the benchmarks count statements run beside the engine's events
    return None if row is None else row[0]


@dataclass(frozen=True)
class HostFacts:
    endpoint: str | None
    migration_uri: str | None
    driver_version: str | None
    version: str
    heartbeat_s: float
    stale_after_s: float


def lock_host(s: Session, host_id: int) -> None:
    """One publish of a host at a time, until its transaction ends (PostgreSQL). Its processes (the service, a
    hook, the CLI) publish into the same rows in two orders: a full publish the GPU row, then the capacity rows;
    a change (one statement) the capacity rows, then the GPU row and the host row. Two at once deadlocked
    (tests/test_fleet_publish.py). SQLite has one writer at a time already. The change statement (_PG_CHANGE)
    takes the same lock itself, first."""
    if _pg(s):
        _run(s, "lock", {"h": host_id}, sql=_PUBLISH_LOCK)


def try_lock_host(s: Session, host_id: int) -> bool:
    """lock_host without waiting: False where another transaction holds the lock."""
    return not _pg(s) or bool(_run(s, "", {"h": host_id}, sql=_TRY_LOCK, fetch=True))


def write_host(s: Session, host_id: int, facts: HostFacts, gpus: int, vgpus: int) -> bool:
    """This host's row, heartbeat now, one generation further; False where its summary is behind (a change left it,
    and this publish wrote no GPU's rows: the caller sums it afresh)."""
    values = {"host_id": host_id, "endpoint": facts.endpoint, "migration_uri": facts.migration_uri,
              "driver_version": facts.driver_version, "version": facts.version, "heartbeat_s": facts.heartbeat_s,
              "stale_after_s": facts.stale_after_s, "gpus": gpus, "vgpus": vgpus}
    if _pg(s):
        return bool(_run(s, "host", values, fetch=True))
    _run(s, "host", [*values.values(), _sqlite_now()])
    return True


def write_counts(s: Session, host_id: int, gpus: Sequence[GpuCapacity], gpu_count: int, vgpus: int,
                 host: bool = True) -> bool:
    """A change of GPUs whose rows exist: their counts, and (`host`) the host's heartbeat (see _PG_CHANGE). True
    where the host's summary is left behind, to be summed afresh once this commits (`follow`)."""
    types = [(g.address, t) for g in gpus for t in g.types]
    if _pg(s):
        _run(s, "change" if host else "counts", {
            "h": host_id, "gpu": pg_texts(a for a, _ in types), "type_id": pg_texts(t.type for _, t in types),
            "free": pg_ints(t.free for _, t in types),
            "used": pg_ints(t.used for _, t in types), "max": pg_ints(t.max for _, t in types),
            "address": pg_texts(g.address for g in gpus), "vgpus": pg_ints(g.vgpus for g in gpus),
            "mode": pg_texts(g.mode for g in gpus),
            "region_mb": pg_ints(g.region_mb for g in gpus), "used_mb": pg_ints(g.used_mb for g in gpus),
            "gpus": gpu_count, "total": vgpus})
        return host
    now = _sqlite_now()
    if types:
        _run(s, "change-capacity", [(t.free, t.used, t.max, host_id, a, t.type, t.free, t.used, t.max)
                                    for a, t in types], many=True)
    if gpus:
        _run(s, "change-gpus", [(g.vgpus, g.mode, g.region_mb, g.used_mb, now, now, host_id, g.address)
                                for g in gpus], many=True)
    if types:  # after the GPUs' room: the summary's tightest GPU reads it
        refresh_types(s, host_id)
    if host:
        _run(s, "change-host", (now, gpu_count, vgpus, host_id))
    return False


def beat(s: Session, host_id: int) -> int:
    """Only the heartbeat (when the host's state could not be read now): rows changed (0: never published)."""
    return s.execute(update(FleetHost).where(FleetHost.host_id == host_id)
                     .values(heartbeat_at=_now(s))).rowcount or 0


def write_gpus(s: Session, host_id: int, gpus: Sequence[GpuCapacity], prune_types: bool) -> None:
    """The GPUs' rows and every type row of theirs; with `prune_types`, type rows no longer offered go."""
    if not gpus:
        return
    types = [(g, t) for g in gpus for t in g.types]

    def cap(g: GpuCapacity, t: Any, c: str) -> Any:
        return getattr(g if c in ("model", "device_id") else t, c)

    if _pg(s):
        _run(s, "gpus", {"h": host_id, "address": [g.address for g in gpus],
                         **{c: [getattr(g, c) for g in gpus] for c in _GPU_COLS}})
        if types:
            _run(s, "capacity", {"h": host_id, "gpu": [g.address for g, _ in types],
                                 "type_id": [t.type for _, t in types],
                                 **{c: [cap(g, t, c) for g, t in types] for c in _CAP_COLS}})
    else:
        now = _sqlite_now()
        _run(s, "gpus", [(host_id, g.address, *(getattr(g, c) for c in _GPU_COLS), now, now) for g in gpus],
             many=True)
        if types:
            _run(s, "capacity", [(host_id, g.address, t.type, *(cap(g, t, c) for c in _CAP_COLS)) for g, t in types],
                 many=True)
    if prune_types:
        keep = [(g.address, t.type) for g, t in types]
        gone = delete(FleetCapacity).where(FleetCapacity.host_id == host_id,
                                           FleetCapacity.gpu.in_([g.address for g in gpus]))
        if keep:
            gone = gone.where(tuple_(FleetCapacity.gpu, FleetCapacity.type_id).not_in(keep))
        s.execute(gone)
    refresh_types(s, host_id)


def refresh_types(s: Session, host_id: int) -> None:
    """The host's fleet_host_types rows summed afresh from its fleet_capacity rows (one statement on PostgreSQL),
    marked true for its generation."""
    if _pg(s):
        _run(s, "types", {"h": host_id})
        return
    for sql in _SQLITE_TYPES:
        _run_sql(s, sql, {"h": host_id})


def prune_gpus(s: Session, host_id: int, keep: Iterable[str]) -> None:
    """GPUs the host no longer has (their type rows go with them)."""
    keep = list(keep)
    s.execute(delete(FleetCapacity).where(FleetCapacity.host_id == host_id, FleetCapacity.gpu.not_in(keep)))
    if s.execute(delete(FleetGpu).where(FleetGpu.host_id == host_id, FleetGpu.address.not_in(keep))).rowcount:
        refresh_types(s, host_id)
