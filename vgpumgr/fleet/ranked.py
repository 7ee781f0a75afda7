"""The fleet's answers at ten thousand hosts: the best hosts of a type through an index, and the rest counted.

Each host keeps one row per vGPU type it offers (`fleet_host_types`: its GPUs', open GPUs', free and used
instances summed, and the least framebuffer left on a GPU with a free instance), written by a full publish in
its own transaction and, after a change, by the host's follower (vgpumgr.fleet.writes, vgpumgr.fleet.follow). A
partial index over the rows with a free instance, in `pack` order and in `spread` order, gives the hosts a placer
would rank first without reading the others; the freshness of the heartbeat and the cordon are checked in the
same query, so a stale or cordoned host is never among them. The pure placer (vgpumgr.fleet.place) then ranks
those hosts from their own rows, as it ranks a small fleet, so the choice is the one it would make over every
host:
- a host with one board offering the type is walked in the placer's own order (`pack`: the room left on its
  fullest GPU with a free instance, then its free instances, then its name, in byte order);
- a host with two boards offering one type (its summary counts both, a model filter may allow one) and a host
  whose summary is not true for its generation (a change its follower has not summed yet, or an older release,
  which moves its rows alone or its counts without their tightest GPU) are always read from their own rows, and
  counted by the placer's reason for each.
Everything else is counted, not listed: hosts stale, cordoned, not offering the type, without room for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import bindparam, text
from sqlalchemy.orm import Session

from vgpumgr.fleet.store import summary_behind

# a host's heartbeat is within its window: the negation of store.HostRow.stale, by the database's clock; on
# PostgreSQL through the indexed fleet_fresh_until (migration 0016), so the stale hosts are found, and the fresh
# ones estimated, from the index
_FRESH = {
    "postgresql": "fleet_fresh_until(h.heartbeat_at, h.stale_after_s) >= now()",
    "sqlite": "(julianday('now') - julianday(h.heartbeat_at)) * 86400.0 <= h.stale_after_s"}
_STALE = {
    "postgresql": "fleet_fresh_until(h.heartbeat_at, h.stale_after_s) < now()",
    "sqlite": "(julianday('now') - julianday(h.heartbeat_at)) * 86400.0 > h.stale_after_s"}
_UNCORDONED = "NOT EXISTS (SELECT 1 FROM host_cordons c WHERE c.host_id = h.host_id)"


def _dialect(s: Session) -> str:
    return s.get_bind().dialect.name


def host_count(s: Session, up_to: int | None = None) -> int:
    """The hosts that published; with `up_to`, counted no further than `up_to` + 1 (is the fleet larger than
    that?), which reads as many index entries, not every host's."""
    if up_to is None:
        return int(s.execute(text("SELECT count(*) FROM fleet_hosts")).scalar() or 0)
    sql = text("SELECT count(*) FROM (SELECT 1 FROM fleet_hosts LIMIT :n) AS x")
    return int(s.execute(sql, {"n": up_to + 1}).scalar() or 0)


class Counts(NamedTuple):
    hosts: int
    stale: int
    cordoned: int  # and not stale
    not_offered: int  # fresh and not cordoned
    no_capacity: int  # offers the type, no room for the request


# The hosts out of the running (stale: 1, or cordoned and fresh: 0), a few hundred of ten thousand, listed once:
# the stale ones from the freshness index, the cordoned ones each looked up by key (on PostgreSQL a lateral
# subquery that is not flattened: flattened, the planner joined the cordons with every fresh host's index entry).
_OUT = {
    "postgresql": ("WITH out_ AS MATERIALIZED (SELECT h.host_id, 1 AS stale FROM fleet_hosts h WHERE {stale} "
                   "AND h.host_id NOT IN :apart UNION ALL SELECT c.host_id, 0 FROM host_cordons c JOIN LATERAL "
                   "(SELECT 1 FROM fleet_hosts h WHERE h.host_id = c.host_id AND {fresh} OFFSET 0) AS f ON true "
                   "WHERE c.host_id NOT IN :apart)"),
    "sqlite": ("WITH out_ AS (SELECT h.host_id, 1 AS stale FROM fleet_hosts h WHERE {stale} AND h.host_id NOT IN "
               ":apart UNION ALL SELECT h.host_id, 0 FROM host_cordons c JOIN fleet_hosts h ON h.host_id = c.host_id "
               "WHERE {fresh} AND h.host_id NOT IN :apart)")}


def counts(s: Session, short: str, count: int, nvidia: bool, apart: Sequence[int] = ()) -> Counts:
    """Every host by why it could not take `count` of the type before any policy, in one statement without a
    pass over the hosts' rows: the type's summary rows counted by room in one pass of their index
    (ix_fleet_host_types_room), the few hosts out of the running looked up by key and taken off, and the hosts
    counted from their smallest index. The hosts `apart` (read from their own rows and judged by the placer:
    `irregular`) are in `hosts` only: a summary behind would count them by what they held before."""
    d = _dialect(s)
    room = "t.open_gpus >= :count" if nvidia else "t.free >= :count"
    sql = text(
        _OUT[d].format(stale=_STALE[d], fresh=_FRESH[d])
        + ", typed AS (SELECT count(*) AS n, count(*) FILTER (WHERE " + room + ") AS roomy FROM fleet_host_types t "
        "WHERE t.short = :short), "
        # the hosts out of the running and those apart, looked up by key (the pass above stays on the index alone)
        "typed_out AS (SELECT count(*) AS n, count(*) FILTER (WHERE " + room + ") AS roomy FROM (SELECT o.host_id "
        "FROM out_ o UNION ALL SELECT h.host_id FROM fleet_hosts h WHERE h.host_id IN :apart) AS o "
        "JOIN fleet_host_types t ON t.host_id = o.host_id AND t.short = :short) "
        "SELECT (SELECT count(*) FROM fleet_hosts), typed.n, typed.roomy, (SELECT sum(o.stale) FROM out_ o), "
        "(SELECT count(*) - sum(o.stale) FROM out_ o), typed_out.n, typed_out.roomy FROM typed, typed_out"
    ).bindparams(bindparam("apart", expanding=True))
    apart = sorted(set(apart))
    hosts, offering, roomy, stale, cordoned, offering_out, roomy_out = (
        int(x or 0) for x in s.execute(sql, {"short": short, "count": count, "apart": apart or [-1]}).one())
    offered = offering - offering_out  # by fresh, uncordoned hosts not apart
    return Counts(hosts, stale, cordoned, hosts - len(apart) - stale - cordoned - offered,
                  offered - (roomy - roomy_out))


def candidates(s: Session, short: str, count: int, nvidia: bool, strategy: str, offset: int, limit: int,
               board: str | None = None, driver: str | None = None, best_fit: bool = True) -> list[int]:
    """Hosts with one board offering the type, fresh, not cordoned, with room for `count`, in the placer's order
    (`pack`: the least framebuffer left on a GPU with a free instance, then fewest free; `spread`: most free),
    `limit` of them from `offset`; `board` and `driver` (a migrating
    VM's) leave out hosts NVIDIA's rules refuse anyway. A host whose summary is behind its generation may be
    among them: the caller reads it from its own rows (`irregular`) and skips it here. (Asking for summarized
    hosts here made the planner, which cannot estimate `types_generation = generation`, join every host.)"""
    order = ("(-t.free), t.host" if strategy != "pack" else "t.tightest_mb NULLS LAST, t.free, t.host" if best_fit
             else "t.free, t.host")
    room = "t.open_gpus >= :count" if nvidia else "t.free >= :count"
    where = [f"t.short = :short AND t.free > 0 AND t.boards = 1 AND {room}", _FRESH[_dialect(s)], _UNCORDONED]
    params: dict[str, Any] = {"short": short, "count": count}  # LIMIT and OFFSET written in: compaction.full_gpus
    if board:
        # the column itself (hosts publish it in lower case; upper case as well, for a hand-written one): the
        # planner then knows from its statistics that most of a type's rows have the board, and walks the index
        # in order; against lower(device_id) it guessed 0.5 %, sorted all 3,300 rows and took 35-50 ms
        where.append("t.device_id IN (:board, :board_upper)")
        params.update(board=board.lower(), board_upper=board.upper())
    if driver:
        where.append("(h.driver_version IS NULL OR h.driver_version = :driver)")
        params["driver"] = driver
    sql = text(f"SELECT t.host_id FROM fleet_host_types t JOIN fleet_hosts h ON h.host_id = t.host_id "
               f"WHERE {' AND '.join(where)} ORDER BY {order} LIMIT {int(limit)} OFFSET {int(offset)}")
    return [r[0] for r in s.execute(sql, params)]


def irregular(s: Session, short: str, best_fit: bool = True) -> list[int]:
    """Hosts read from their own rows whatever their rank: two boards offering the type, or a summary (or, with
    `best_fit`, its tightest GPUs) not true for the host's generation (both rare: partial indexes find them, the
    second empty once every host runs this release)."""
    fit = (" UNION SELECT host_id FROM fleet_hosts h WHERE h.fit_generation IS NULL OR h.fit_generation <> "
           "h.generation") if best_fit else ""
    sql = text("SELECT host_id FROM fleet_host_types WHERE short = :short AND boards > 1 "
               "UNION SELECT host_id FROM fleet_hosts h WHERE h.types_generation IS NULL "
               "OR h.types_generation <> h.generation" + fit)
    return [r[0] for r in s.execute(sql, {"short": short})]


def fit_behind(s: Session, up_to: int) -> int:
    """Hosts whose tightest GPUs alone are not true for their generation (they run the previous release, or have
    not published since the upgrade), counted no further than `up_to` + 1 through their partial index. A host whose
    whole summary is behind (a change its follower has not summed yet) is read from its rows anyway: not counted,
    so a burst of changes across the fleet never changes `pack`'s order."""
    sql = text("SELECT count(*) FROM (SELECT 1 FROM fleet_hosts h WHERE (h.fit_generation IS NULL "
               "OR h.fit_generation <> h.generation) AND h.types_generation = h.generation LIMIT :n) AS x")
    return int(s.execute(sql, {"n": up_to + 1}).scalar() or 0)


# -- the fleet page ----------------------------------------------------------------------------------------

# a host's state by the stale hosts found through the index (a hashed list), not by the heartbeat of each host
_STALE_IDS = "(SELECT x.host_id FROM fleet_hosts x WHERE {stale})"
_STATE = {"stale": "h.host_id IN {ids}", "cordoned": "c.host_id IS NOT NULL AND h.host_id NOT IN {ids}",
          "ok": "c.host_id IS NULL AND h.host_id NOT IN {ids}"}


def _stale_ids(s: Session) -> str:
    return _STALE_IDS.format(stale=_STALE[_dialect(s)].replace("h.", "x."))


def page_counts(s: Session) -> dict[str, int]:
    """The hosts by state, and their GPUs and vGPUs: one plain pass for the sums, the stale and the cordoned
    hosts through their indexes."""
    ids = _stale_ids(s)
    r = s.execute(text(
        "SELECT (SELECT count(*) FROM fleet_hosts), "
        f"(SELECT count(*) FROM fleet_hosts h WHERE {_STATE['stale'].format(ids=ids)}), "
        "(SELECT count(*) FROM host_cordons c JOIN fleet_hosts h ON h.host_id = c.host_id "
        f"WHERE {_STATE['cordoned'].format(ids=ids)}), "
        "(SELECT sum(gpus) FROM fleet_hosts), (SELECT sum(vgpus) FROM fleet_hosts)")).one()
    hosts, stale, cordoned, gpus, vgpus = (int(x or 0) for x in r)
    return {"hosts": hosts, "ok": hosts - stale - cordoned, "stale": stale, "cordoned": cordoned, "gpus": gpus,
            "vgpus": vgpus}


# the hosts offering a type: by their summary (the type's index), or by their own rows where the summary is behind
# (those hosts named, store.summary_behind)
_OFFERS = ("((h.host_id IN (SELECT t.host_id FROM fleet_host_types t WHERE t.short = :short) AND h.host_id NOT IN "
           ":behind) OR h.host_id IN (SELECT f.host_id FROM fleet_capacity f WHERE f.host_id IN :behind AND "
           "f.short = :short))")


def page_hosts(s: Session, short: str | None, state: str | None, offset: int, limit: int) -> tuple[list[int], int]:
    """One page of hosts by name (offering `short`, in `state`), and how many match."""
    where, params = ["true"], {"limit": limit, "offset": offset}
    if short:
        where.append(_OFFERS)
        params.update(short=short, behind=summary_behind(s))
    if state:
        where.append(_STATE[state].format(ids=_stale_ids(s)))
    base = (f"FROM fleet_hosts h JOIN hosts n ON n.id = h.host_id LEFT JOIN host_cordons c ON c.host_id = h.host_id "
            f"WHERE {' AND '.join(where)}")

    def sql(q: str) -> Any:
        return text(q).bindparams(bindparam("behind", expanding=True)) if short else text(q)

    matching = int(s.execute(sql(f"SELECT count(*) {base}"), params).scalar() or 0)
    ids = [r[0] for r in s.execute(sql(f"SELECT h.host_id {base} ORDER BY n.name LIMIT :limit OFFSET :offset"),
                                   params)]
    return ids, matching


def placeable_free(s: Session, short: str) -> int:
    """Free instances of the type on hosts a placer may choose (fresh, not cordoned)."""
    sql = text(f"SELECT sum(f.free) FROM fleet_capacity f JOIN fleet_hosts h ON h.host_id = f.host_id "
               f"WHERE f.short = :short AND {_FRESH[_dialect(s)]} AND {_UNCORDONED}")
    return int(s.execute(sql, {"short": short}).scalar() or 0)
