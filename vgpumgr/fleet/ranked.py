"""The fleet's answers at ten thousand hosts: the best hosts of a type through an index, and the rest counted.

Each host keeps one row per vGPU type it offers (`fleet_host_types`: its GPUs', open GPUs', free and used
instances summed), written in the transaction of every publish that moves its `fleet_capacity` rows
(vgpumgr.fleet.writes). A partial index over the rows with a free instance, in `pack` order and in `spread`
order, gives the hosts a placer would rank first without reading the others; the freshness of the heartbeat and
the cordon are checked in the same query, so a stale or cordoned host is never among them. The pure placer
(vgpumgr.fleet.place) then ranks those hosts from their own rows, as it ranks a small fleet, so the choice is the
one it would make over every host:
- a host with one board offering the type is walked in the placer's own order (its free instances, then its
  name, in byte order);
- a host with two boards offering one type (its summary counts both, a model filter may allow one) and a host
  whose summary is not true for its generation (it runs the previous release, which moves its rows alone) are
  always read from their own rows.
Everything else is counted, not listed: hosts stale, cordoned, not offering the type, without room for it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sqlalchemy import text
from sqlalchemy.orm import Session

# a host's heartbeat is within its window: the negation of store.HostRow.stale, by the database's clock
_FRESH = {
    "postgresql": "h.heartbeat_at >= now() - h.stale_after_s * interval '1 second'",
    "sqlite": "(julianday('now') - julianday(h.heartbeat_at)) * 86400.0 <= h.stale_after_s"}
_UNCORDONED = "NOT EXISTS (SELECT 1 FROM host_cordons c WHERE c.host_id = h.host_id)"
_SUMMARIZED = "h.types_generation = h.generation"


def _dialect(s: Session) -> str:
    return s.get_bind().dialect.name


def host_count(s: Session) -> int:
    return int(s.execute(text("SELECT count(*) FROM fleet_hosts")).scalar() or 0)


class Counts(NamedTuple):
    hosts: int
    stale: int
    cordoned: int  # and not stale
    not_offered: int  # fresh and not cordoned
    no_capacity: int  # offers the type, no room for the request


def counts(s: Session, short: str, count: int, nvidia: bool) -> Counts:
    """Every host by why it could not take `count` of the type before any policy (one pass over the hosts)."""
    fresh = _FRESH[_dialect(s)]
    room = "t.open_gpus >= :count" if nvidia else "t.free >= :count"
    sql = text(
        f"SELECT count(*), sum(CASE WHEN NOT ({fresh}) THEN 1 ELSE 0 END), "
        f"sum(CASE WHEN ({fresh}) AND c.host_id IS NOT NULL THEN 1 ELSE 0 END), "
        f"sum(CASE WHEN ({fresh}) AND c.host_id IS NULL AND t.host_id IS NULL THEN 1 ELSE 0 END), "
        f"sum(CASE WHEN ({fresh}) AND c.host_id IS NULL AND t.host_id IS NOT NULL AND NOT ({room}) THEN 1 ELSE 0 END) "
        "FROM fleet_hosts h LEFT JOIN host_cordons c ON c.host_id = h.host_id "
        "LEFT JOIN fleet_host_types t ON t.host_id = h.host_id AND t.short = :short")
    r = s.execute(sql, {"short": short, "count": count}).one()
    return Counts(*(int(x or 0) for x in r))


def candidates(s: Session, short: str, count: int, nvidia: bool, strategy: str, offset: int, limit: int,
               board: str | None = None, driver: str | None = None) -> list[int]:
    """Hosts with one board offering the type, fresh, not cordoned, with room for `count`, summarized, in the
    placer's order (`pack`: fewest free first; `spread`: most), `limit` of them from `offset`; `board` and
    `driver` (a migrating VM's) leave out hosts NVIDIA's rules refuse anyway."""
    order = "t.free, t.host" if strategy == "pack" else "(-t.free), t.host"
    room = "t.open_gpus >= :count" if nvidia else "t.free >= :count"
    where = [f"t.short = :short AND t.free > 0 AND t.boards = 1 AND {room}", _FRESH[_dialect(s)], _UNCORDONED,
             _SUMMARIZED]
    params: dict[str, Any] = {"short": short, "count": count, "limit": limit, "offset": offset}
    if board:
        where.append("lower(t.device_id) = :board")
        params["board"] = board.lower()
    if driver:
        where.append("(h.driver_version IS NULL OR h.driver_version = :driver)")
        params["driver"] = driver
    sql = text(f"SELECT t.host_id FROM fleet_host_types t JOIN fleet_hosts h ON h.host_id = t.host_id "
               f"WHERE {' AND '.join(where)} ORDER BY {order} LIMIT :limit OFFSET :offset")
    return [r[0] for r in s.execute(sql, params)]


def irregular(s: Session, short: str) -> list[int]:
    """Hosts read from their own rows whatever their rank: two boards offering the type, or a summary not true
    for the host's generation (both rare: a partial index finds the first, the second is empty once every host
    runs this release)."""
    sql = text("SELECT host_id FROM fleet_host_types WHERE short = :short AND boards > 1 "
               "UNION SELECT host_id FROM fleet_hosts h WHERE h.types_generation IS NULL "
               "OR h.types_generation <> h.generation")
    return [r[0] for r in s.execute(sql, {"short": short})]


def no_capacity_hosts(s: Session, short: str, limit: int) -> list[int]:
    """Fresh, uncordoned hosts offering the type with no free instance of it (where compaction may make one)."""
    sql = text(f"SELECT t.host_id FROM fleet_host_types t JOIN fleet_hosts h ON h.host_id = t.host_id "
               f"WHERE t.short = :short AND t.free = 0 AND {_FRESH[_dialect(s)]} AND {_UNCORDONED} "
               "ORDER BY t.host LIMIT :limit")
    return [r[0] for r in s.execute(sql, {"short": short, "limit": limit})]


# -- the fleet page ----------------------------------------------------------------------------------------

_STATE = {"stale": "NOT ({fresh})", "cordoned": "({fresh}) AND c.host_id IS NOT NULL",
          "ok": "({fresh}) AND c.host_id IS NULL"}


def page_counts(s: Session) -> dict[str, int]:
    fresh = _FRESH[_dialect(s)]
    r = s.execute(text(
        f"SELECT count(*), sum(CASE WHEN {_STATE['ok'].format(fresh=fresh)} THEN 1 ELSE 0 END), "
        f"sum(CASE WHEN {_STATE['stale'].format(fresh=fresh)} THEN 1 ELSE 0 END), "
        f"sum(CASE WHEN {_STATE['cordoned'].format(fresh=fresh)} THEN 1 ELSE 0 END), sum(h.gpus), sum(h.vgpus) "
        "FROM fleet_hosts h LEFT JOIN host_cordons c ON c.host_id = h.host_id")).one()
    return dict(zip(("hosts", "ok", "stale", "cordoned", "gpus", "vgpus"), (int(x or 0) for x in r), strict=True))


def page_hosts(s: Session, short: str | None, state: str | None, offset: int, limit: int) -> tuple[list[int], int]:
    """One page of hosts by name (offering `short`, in `state`), and how many match."""
    where, params = ["true"], {"limit": limit, "offset": offset}
    if short:
        where.append("EXISTS (SELECT 1 FROM fleet_capacity f WHERE f.host_id = h.host_id AND f.short = :short)")
        params["short"] = short
    if state:
        where.append(_STATE[state].format(fresh=_FRESH[_dialect(s)]))
    base = (f"FROM fleet_hosts h JOIN hosts n ON n.id = h.host_id LEFT JOIN host_cordons c ON c.host_id = h.host_id "
            f"WHERE {' AND '.join(where)}")
    matching = int(s.execute(text(f"SELECT count(*) {base}"), params).scalar() or 0)
    ids = [r[0] for r in s.execute(text(f"SELECT h.host_id {base} ORDER BY n.name LIMIT :limit OFFSET :offset"),
                                   params)]
    return ids, matching


def placeable_free(s: Session, short: str) -> int:
    """Free instances of the type on hosts a placer may choose (fresh, not cordoned)."""
    sql = text(f"SELECT sum(f.free) FROM fleet_capacity f JOIN fleet_hosts h ON h.host_id = f.host_id "
               f"WHERE f.short = :short AND {_FRESH[_dialect(s)]} AND {_UNCORDONED}")
    return int(s.execute(sql, {"short": short}).scalar() or 0)
