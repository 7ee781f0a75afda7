"""The fleet's rows as anyone reads them: the hosts, one type's rows grouped per host and board, a fleet page's
slot maps, a VM's home. A few indexed queries, whatever the size of the fleet (vgpumgr.fleet.writes writes them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import and_, bindparam, case, func, select, text
from sqlalchemy.orm import Session

from vgpumgr.db.models import ALLOC_ACTIVE, LIVE_STATES, Allocation, FleetCapacity, FleetGpu, Host, Vm

# -- reads (anyone) ---------------------------------------------------------------------------------------------
# A placer reads every host and one type's rows grouped per host and board: about one row per host, however many
# GPUs and types the hosts have (text() statements: compiled once, rows without type processing).

class HostRow(NamedTuple):
    host_id: int
    name: str
    endpoint: str | None
    migration_uri: str | None
    driver_version: str | None
    version: str
    heartbeat_s: float
    stale_after_s: float
    heartbeat_epoch: float  # its last heartbeat, seconds since 1970 (UTC)
    age_s: float  # seconds since its last heartbeat, by the database's clock
    generation: int
    gpus: int
    vgpus: int
    cordoned: bool
    cordon_reason: str | None
    cordoned_by: str | None

    @property
    def stale(self) -> bool:
        return self.age_s > self.stale_after_s

    @property
    def heartbeat_at(self) -> str:
        return datetime.fromtimestamp(self.heartbeat_epoch, UTC).isoformat()


# the heartbeat and its age as plain numbers: a thousand time stamps parsed into datetimes cost more than the query
_EPOCH = {"postgresql": "EXTRACT(EPOCH FROM h.heartbeat_at)::float8",
          "sqlite": "(julianday(h.heartbeat_at) - 2440587.5) * 86400.0"}
_AGE = {"postgresql": "EXTRACT(EPOCH FROM (now() - h.heartbeat_at))::float8",
        "sqlite": "(julianday('now') - julianday(h.heartbeat_at)) * 86400.0"}
_EPOCH_AGE = {d: f"{_EPOCH[d]}, {_AGE[d]}" for d in _EPOCH}


def hosts(s: Session, host_ids: Sequence[int] | None = None) -> list[HostRow]:
    """Every host that has published (or those of `host_ids`), with its cordon and its heartbeat's age (one
    query)."""
    dialect = s.get_bind().dialect.name
    where = "" if host_ids is None else "WHERE h.host_id IN :ids "
    sql = text("SELECT h.host_id, n.name, h.endpoint, h.migration_uri, h.driver_version, h.version, h.heartbeat_s, "
               f"h.stale_after_s, {_EPOCH_AGE[dialect]}, h.generation, h.gpus, h.vgpus, "
               "c.host_id IS NOT NULL, c.reason, c.cordoned_by FROM fleet_hosts h JOIN hosts n ON n.id = h.host_id "
               f"LEFT JOIN host_cordons c ON c.host_id = h.host_id {where}ORDER BY n.name")
    if host_ids is not None:
        if not host_ids:
            return []
        sql = sql.bindparams(bindparam("ids", expanding=True))
    params = {} if host_ids is None else {"ids": list(host_ids)}
    return [HostRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], max(0.0, r[9]), r[10], r[11], r[12],
                    bool(r[13]), r[14], r[15]) for r in s.execute(sql, params).all()]


def type_match(wanted: str) -> str:
    """The short name a request names: `GRID T4-4Q` and `T4-4Q` are one type (hosts publish short names)."""
    from vgpumgr.ids import parse_type_name

    w = wanted.strip()
    parsed = parse_type_name(w)
    return parsed.short if parsed else (w.split()[-1] if w else w)


class OfferGroup(NamedTuple):
    """One host's GPUs of one board that offer the wanted type."""

    host_id: int
    model: str
    device_id: str
    name: str  # the type's name on that board
    gpus: int
    open_gpus: int  # of them with a free instance
    free: int
    used: int
    tightest_mb: int | None = None  # of them with a free instance, the least framebuffer left (None: not known)


# a GPU's room (fleet_gpus g) where this release wrote it with the GPU's rows (a previous release's publish leaves
# it behind): read here, and summed into each host's best fit by vgpumgr.fleet.writes
ROOM = "CASE WHEN g.room_at = g.published_at THEN g.region_mb - g.used_mb END"


def offer_groups(s: Session, wanted: str, host_ids: Sequence[int] | None = None) -> list[OfferGroup]:
    where = "" if host_ids is None else " AND c.host_id IN :ids"
    sql = text("SELECT c.host_id, c.model, c.device_id, min(c.name), count(*), "
               "sum(CASE WHEN c.free > 0 THEN 1 ELSE 0 END), sum(c.free), sum(c.used), "
               f"min(CASE WHEN c.free > 0 THEN {ROOM} END) FROM fleet_capacity c JOIN fleet_gpus g "
               f"ON g.host_id = c.host_id AND g.address = c.gpu WHERE c.short = :short{where} "
               "GROUP BY c.host_id, c.model, c.device_id")
    params: dict[str, Any] = {"short": type_match(wanted)}
    if host_ids is not None:
        if not host_ids:
            return []
        sql = sql.bindparams(bindparam("ids", expanding=True))
        params["ids"] = list(host_ids)
    return [OfferGroup(*r) for r in s.execute(sql, params).all()]


class GpuOffer(NamedTuple):
    host_id: int
    gpu: str
    model: str
    device_id: str
    name: str
    free: int
    room_mb: int | None = None  # framebuffer left on the GPU (None: not known)


def open_gpus(s: Session, wanted: str, host_ids: Sequence[int]) -> list[GpuOffer]:
    """The GPUs of `host_ids` with a free instance of the type (where a choice's vGPUs would go)."""
    if not host_ids:
        return []
    sql = text(f"SELECT c.host_id, c.gpu, c.model, c.device_id, c.name, c.free, {ROOM} FROM fleet_capacity c "
               "JOIN fleet_gpus g ON g.host_id = c.host_id AND g.address = c.gpu WHERE c.short = :short "
               "AND c.free > 0 AND c.host_id IN :ids").bindparams(bindparam("ids", expanding=True))
    return [GpuOffer(*r) for r in s.execute(sql, {"short": type_match(wanted), "ids": list(host_ids)})]


# Per host and type: the summary a host keeps (fleet_host_types) where it is true for the host's generation, else
# the host's own rows summed (a change its follower has not summed yet, or a host still running the previous
# release; see vgpumgr.fleet.ranked). The hosts whose summary is behind are looked up first (`summary_behind`) and
# named: the planner cannot estimate `types_generation <> generation`, guessed nearly every host, and read every row
# of the type to join them (70 ms of capacity --type at 10,000 hosts while hosts published).
_HOST_TYPES = (
    "SELECT t.host_id, t.short, t.name, t.framebuffer_mb, t.gpus, t.open_gpus, t.free, t.used, t.max "
    "FROM fleet_host_types t WHERE t.host_id NOT IN :behind{t} UNION ALL "
    "SELECT c.host_id, c.short, min(c.name), min(c.framebuffer_mb), count(*), "
    "sum(CASE WHEN c.free > 0 THEN 1 ELSE 0 END), sum(c.free), sum(c.used), sum(coalesce(c.max, 0)) "
    "FROM fleet_capacity c WHERE c.host_id IN :behind{c} GROUP BY c.host_id, c.short")


def summary_behind(s: Session) -> list[int]:
    """Hosts whose summary is behind their generation, from their partial index (a few at any moment); [-1] for
    none, so that `IN :behind` stays valid SQL."""
    sql = text("SELECT host_id FROM fleet_hosts WHERE types_generation IS NULL OR types_generation <> generation")
    return [h for (h,) in s.execute(sql)] or [-1]


def _host_types(sql: str) -> Any:
    return text(sql).bindparams(bindparam("behind", expanding=True))


class HostCapacity(NamedTuple):
    """One host's instances of one type, with what decides whether a placer may choose it."""

    name: str  # the host's
    type_name: str
    gpus: int  # offering the type
    gpus_free: int  # of them with a free instance
    free: int
    used: int
    max: int
    stale: bool
    cordoned: bool


def capacity_by_host(s: Session, wanted: str) -> list[HostCapacity]:
    """Per host offering the type `wanted` names: its instances, and whether it is stale or cordoned; in one
    query that reads only those hosts' rows (every host's row read and matched in Python took 131 of 190 ms at
    10,000 hosts)."""
    age = _AGE[s.get_bind().dialect.name]
    sql = _host_types(f"SELECT n.name, x.name, x.gpus, x.open_gpus, x.free, x.used, x.max, {age} > h.stale_after_s, "
                      "c.host_id IS NOT NULL FROM ("
                      + _HOST_TYPES.format(t=" AND t.short = :short", c=" AND c.short = :short") + ") AS x "
                      "JOIN fleet_hosts h ON h.host_id = x.host_id JOIN hosts n ON n.id = x.host_id "
                      "LEFT JOIN host_cordons c ON c.host_id = x.host_id")
    return [HostCapacity(r[0], r[1], r[2], r[3], r[4], r[5], r[6], bool(r[7]), bool(r[8]))
            for r in s.execute(sql, {"short": type_match(wanted), "behind": summary_behind(s)})]


class OfferRow(NamedTuple):
    """One GPU's capacity for a type, with the GPU's facts (listings)."""

    host_id: int
    gpu: str
    type_id: str
    name: str
    free: int
    used: int
    max: int | None


def offers(s: Session, wanted: str, host_ids: Iterable[int] | None = None) -> list[OfferRow]:
    """Every published GPU's row for the type `wanted` names."""
    c = FleetCapacity
    q = select(c.host_id, c.gpu, c.type_id, c.name, c.free, c.used, c.max).where(c.short == type_match(wanted))
    if host_ids is not None:
        q = q.where(c.host_id.in_(list(host_ids)))
    return [OfferRow(*r) for r in s.execute(q)]


def gpus(s: Session, host_ids: Iterable[int] | None = None) -> list[tuple[FleetGpu, int, int, int]]:
    """Published GPUs with, per GPU, (types offered, types with a free instance, free instances in all)."""
    ids = None if host_ids is None else list(host_ids)
    c = FleetCapacity
    grouped = select(c.host_id, c.gpu, func.count().label("types"),
                     func.sum(case((c.free > 0, 1), else_=0)).label("open"), func.sum(c.free).label("free"))
    if ids is not None:  # in the grouping itself: the planner does not push it into a grouped subquery
        grouped = grouped.where(c.host_id.in_(ids))
    counts = grouped.group_by(c.host_id, c.gpu).subquery()
    q = (select(FleetGpu, counts.c.types, counts.c.open, counts.c.free)
         .outerjoin(counts, and_(counts.c.host_id == FleetGpu.host_id, counts.c.gpu == FleetGpu.address))
         .order_by(FleetGpu.host_id, FleetGpu.address))
    if ids is not None:
        q = q.where(FleetGpu.host_id.in_(ids))
    return [(r[0], int(r[1] or 0), int(r[2] or 0), int(r[3] or 0)) for r in s.execute(q)]


def capacity_by_type(s: Session) -> list[dict[str, Any]]:
    """Per type short name across the fleet: hosts and GPUs that offer it, and free and used instances."""
    sql = _host_types("SELECT short, min(name), count(*), sum(gpus), sum(free), sum(used), min(framebuffer_mb) FROM ("
                      + _HOST_TYPES.format(t="", c="") + ") AS x GROUP BY short ORDER BY min(framebuffer_mb), short")
    return [{"type": r[0], "name": r[1], "hosts": int(r[2]), "gpus": int(r[3]), "free": int(r[4] or 0),
             "used": int(r[5] or 0), "framebuffer_mb": r[6]} for r in s.execute(sql, {"behind": summary_behind(s)})]


class SlotRow(NamedTuple):
    host_id: int
    gpu: str
    short: str
    framebuffer_mb: int | None
    free: int
    used: int
    max: int | None


def slot_rows(s: Session, host_ids: Sequence[int], wanted: str | None = None) -> list[SlotRow]:
    """The types in use on these hosts' GPUs, and the wanted type's row on each (a fleet page's slot maps)."""
    if not host_ids:
        return []
    where = "(used > 0 OR short = :short)" if wanted else "used > 0"
    sql = text(f"SELECT host_id, gpu, short, framebuffer_mb, free, used, max FROM fleet_capacity WHERE {where} "
               "AND host_id IN :ids ORDER BY host_id, gpu, framebuffer_mb, short"
               ).bindparams(bindparam("ids", expanding=True))
    params: dict[str, Any] = {"ids": list(host_ids)}
    if wanted:
        params["short"] = type_match(wanted)
    return [SlotRow(*r) for r in s.execute(sql, params).all()]


class VmVgpu(NamedTuple):
    host_id: int
    host: str
    type_name: str | None
    gpu: str | None


def vm_vgpus(s: Session, vm: str) -> list[VmVgpu]:
    """The live vGPUs of VM `vm` on whichever host records them (the VM name index); a host where they are active
    first (while a migration is under way the destination holds them reserved)."""
    q = (select(Allocation.host_id, Host.name, Allocation.type_name, Allocation.detail)
         .join(Vm, Vm.id == Allocation.vm_id).join(Host, Host.id == Allocation.host_id)
         .where(Vm.name == vm, Allocation.state.in_(LIVE_STATES))
         .order_by(case((Allocation.state == ALLOC_ACTIVE, 0), else_=1), Host.name, Allocation.id))
    return [VmVgpu(r[0], r[1], r[2], (r[3] or {}).get("gpu")) for r in s.execute(q)]
