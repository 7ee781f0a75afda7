"""NVIDIA vGPU licence editions, seat pools and leases.

Long because: the ledger's whole life is here (pools, taking, sharing and moving a seat with a migrating
VM, giving it back, usage), kept together so every seat rule is read in one place.

The guest, not the host, talks to NVIDIA's licence server; vgpumgr keeps its own ledger so a
placement can be refused (or flagged) before a VM ends up unlicensed and throttled.

* A vGPU type's series decides which editions satisfy it: A -> vApps; B -> vPC or vWS;
  C -> vCS or vWS; Q -> vWS. Passthrough GPUs take whatever the operator configures.
* A pool has an edition, a seat count, a unit and an optional expiry date (valid through that day).
  Unit "vm": one seat per VM holding at least one vGPU of that edition, however many it holds.
  Unit "gpu": one seat per physical GPU a VM uses (two vGPUs of one VM on one GPU share a seat).
* A request takes a seat from the cheapest edition that has a free one (vApps < vPC < vCS < vWS),
  after first reusing a seat the VM already holds that covers it.
* Modes: enforce (no seat -> NoSeat), warn (allow, write a warning audit event), off (no ledger).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import TypeVar

from sqlalchemy import Boolean, and_, bindparam, case, func, insert, or_, select, update
from sqlalchemy.orm import Session, make_transient_to_detached
from sqlalchemy.orm.attributes import set_committed_value

from vgpumgr.audit import chain as audit
from vgpumgr.db.models import (
    LIVE_STATES,
    OUTCOME_WARNING,
    UNIT_GPU,
    UNIT_VM,
    Allocation,
    Gpu,
    Host,
    LicenceLease,
    LicencePool,
    Vm,
    utcnow,
)
from vgpumgr.errors import Conflict, InvalidInput, NoSeat, NotFound

EDITIONS = ("vApps", "vPC", "vCS", "vWS")  # cheapest first
EDITION_COST = {edition: rank for rank, edition in enumerate(EDITIONS)}
SERIES_EDITIONS: dict[str, tuple[str, ...]] = {
    "A": ("vApps",),
    "B": ("vPC", "vWS"),
    "C": ("vCS", "vWS"),
    "Q": ("vWS",),
}
PASSTHROUGH = "passthrough"
# NVIDIA's licensing guide: vApps, vCS and vWS each also cover a GPU in passthrough.
DEFAULT_PASSTHROUGH_EDITIONS: tuple[str, ...] = ("vApps", "vCS", "vWS")
UNITS = (UNIT_VM, UNIT_GPU)
MODE_ENFORCE = "enforce"
MODE_WARN = "warn"
MODE_OFF = "off"
MODES = (MODE_ENFORCE, MODE_WARN, MODE_OFF)
T = TypeVar("T")
_POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def edition(text: str) -> str:
    """The canonical edition name (case-insensitive input), or InvalidInput."""
    for e in EDITIONS:
        if (text or "").strip().lower() == e.lower():
            return e
    raise InvalidInput(f"'{text}' is not a licence edition", hint=f"use one of {', '.join(EDITIONS)}")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise InvalidInput(f"licence mode '{mode}' is unknown", hint=f"use one of {', '.join(MODES)}")
    return mode


def edition_candidates(series: str | None,
                       passthrough_editions: Sequence[str] | None = None) -> list[str]:
    """Editions that license a vGPU of `series` (A/B/C/Q, or "passthrough"), cheapest first.

    An empty list means no NVIDIA licence applies (e.g. an mtty or i915 mdev has no series)."""
    if not series:
        return []
    if series == PASSTHROUGH:
        chosen = {edition(e) for e in (passthrough_editions or DEFAULT_PASSTHROUGH_EDITIONS)}
        return sorted(chosen, key=EDITION_COST.__getitem__)
    editions = SERIES_EDITIONS.get(series.upper())
    if editions is None:
        raise InvalidInput(f"'{series}' is not a vGPU series",
                           hint="series is the type name's last letter: A, B, C or Q (or 'passthrough')")
    return list(editions)


def _today(today: date | None) -> date:
    return today or utcnow().date()


def _valid(today: date):  # noqa: ANN202 - a SQL expression
    return or_(LicencePool.expires.is_(None), LicencePool.expires >= today)


# -- pools -------------------------------------------------------------------------------------------

def add_pool(session: Session, *, name: str, edition_name: str, seats: int, unit: str = UNIT_VM,
             expires: date | None = None) -> LicencePool:
    if not _POOL_NAME.match(name or ""):
        raise InvalidInput(f"'{name}' is not a usable pool name",
                           hint="use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    if unit not in UNITS:
        raise InvalidInput(f"licence unit '{unit}' is unknown",
                           hint="use 'vm' (per VM) or 'gpu' (per physical GPU)")
    if seats < 0:
        raise InvalidInput(f"a pool cannot have {seats} seats", hint="give 0 or more seats")
    if session.scalar(select(LicencePool.id).where(LicencePool.name == name)) is not None:
        raise Conflict(f"licence pool '{name}' already exists",
                       hint="pick another name, or change its seats/expiry instead")
    pool = LicencePool(name=name, edition=edition(edition_name), seats=seats, unit=unit, expires=expires)
    session.add(pool)
    session.flush()
    return pool


def get_pool(session: Session, name: str) -> LicencePool:
    pool = session.scalar(select(LicencePool).where(LicencePool.name == name))
    if pool is None:
        raise NotFound(f"licence pool '{name}' does not exist", hint="list pools with `vgpumgr license list`")
    return pool


_UNCHANGED = object()


def change_pool(session: Session, name: str, *, seats: int | None = None,
                expires: date | None | object = _UNCHANGED) -> LicencePool:
    """Change seats and/or expiry (expires=None removes the expiry). Fewer seats than are in use is
    allowed (a renewal may shrink); usage() then shows the pool as over-committed."""
    pool = get_pool(session, name)
    if seats is not None:
        if seats < 0:
            raise InvalidInput(f"a pool cannot have {seats} seats", hint="give 0 or more seats")
        pool.seats = seats
    if expires is not _UNCHANGED:
        pool.expires = expires  # type: ignore[assignment]
    session.flush()
    return pool


def remove_pool(session: Session, name: str) -> None:
    pool = get_pool(session, name)
    held = session.scalar(select(func.count()).where(LicenceLease.pool_id == pool.id,
                                                     LicenceLease.released_at.is_(None)))
    if held:
        raise Conflict(f"licence pool '{name}' still has {held} seat(s) in use",
                       hint="remove the vGPUs that hold them first (`vgpumgr license usage` lists holders)")
    for lease in session.scalars(select(LicenceLease).where(LicenceLease.pool_id == pool.id)):
        session.delete(lease)
    session.flush()
    session.delete(pool)
    session.flush()


def list_pools(session: Session) -> list[LicencePool]:
    pools = session.scalars(select(LicencePool)).all()
    return sorted(pools, key=lambda p: (EDITION_COST[p.edition], p.name))


# -- leases ------------------------------------------------------------------------------------------

def _holder(vm: Vm, gpu: Gpu | None, unit: str) -> str:
    return f"vm:{vm.id}" if unit == UNIT_VM else f"vm:{vm.id}/gpu:{gpu.id if gpu else 0}"


def acquire(session: Session, vm: Vm | None, gpu: Gpu | None, series: str | None, mode: str, *,
            allocation: Allocation | None = None, actor: str = "vgpumgr", host_name: str | None = None,
            passthrough_editions: Sequence[str] | None = None, today: date | None = None
            ) -> LicenceLease | None:
    """Take (or reuse) the seat a vGPU of `series` on `gpu` needs for `vm`.

    Pass the lease to store.reserve_allocation(lease=...), or give `allocation` here to link an
    existing one. Returns None when no licence applies (mode off, no series, no VM) or, in warn
    mode, when no seat is free (a warning audit event is written then). In enforce mode a missing
    seat raises NoSeat. Runs inside the placement's transaction; on PostgreSQL an advisory lock
    keeps hosts that share the database from handing out the same last seat twice."""
    check_mode(mode)
    editions = edition_candidates(series, passthrough_editions)
    if mode == MODE_OFF or not editions or vm is None:
        return None
    lease = _reuse_or_take(session, vm, gpu, editions, _today(today))
    if lease is not None:
        if allocation is not None and allocation.lease_id != lease.id:
            session.connection().execute(_LINK, {"aid": allocation.id, "lid": lease.id})
            set_committed_value(allocation, "lease_id", lease.id)
        return lease

    wanted = " or ".join(editions)
    what = "a passthrough GPU" if series == PASSTHROUGH else f"a {str(series).upper()}-series vGPU"
    message = f"no free {wanted} licence seat for {what} in VM '{vm.name}'"
    if mode == MODE_ENFORCE:
        raise NoSeat(message, hint="add seats or a pool (`vgpumgr license add`), free a seat by removing a "
                                   "vGPU, or run with licence mode 'warn'",
                     editions=editions, vm=vm.name)
    host = host_name or session.scalar(select(Host.name).where(Host.id == vm.host_id)) or "?"
    audit.append(session, actor=actor, action=audit.LICENCE_ACQUIRE, outcome=OUTCOME_WARNING, host=host,
                 gpu=gpu.address if gpu else None, vm=vm.name,
                 vgpu=(allocation.uuid or allocation.pci_address) if allocation else None,
                 error=message, detail={"series": series, "editions": editions, "mode": mode})
    return None


_P = LicencePool.__table__
_L = LicenceLease.__table__
_A = Allocation.__table__
# Per candidate pool: seats in use, and a lease this VM already holds there that covers the GPU asked
# for (per-VM leases carry no GPU, so they cover any). One statement.
_POOL_STATS = (
    select(_P, func.count(_L.c.id).label("used"),
           func.max(case((and_(_L.c.vm_id == bindparam("vm_id"),
                               or_(_L.c.gpu_id.is_(None), _L.c.gpu_id == bindparam("gpu_id"))), _L.c.id)))
           .label("reusable"))
    .select_from(_P.outerjoin(_L, and_(_L.c.pool_id == _P.c.id, _L.c.released_at.is_(None))))
    .where(_P.c.edition.in_([bindparam(f"e{i}") for i in range(len(EDITIONS))]),
           or_(_P.c.expires.is_(None), _P.c.expires >= bindparam("today")),
           or_(_P.c.unit == UNIT_VM, bindparam("has_gpu", type_=Boolean)))
    .group_by(*_P.c)
)
_INSERT_LEASE = insert(_L).returning(_L.c.id)
_LINK = update(_A).where(_A.c.id == bindparam("aid")).values(lease_id=bindparam("lid"))
# Free a seat once no live allocation refers to it any more (run after the allocation is released).
_FREE = (update(_L).where(_L.c.id == bindparam("lid"), _L.c.released_at.is_(None),
                          ~select(_A.c.id).where(_A.c.lease_id == bindparam("lid"),
                                                 _A.c.state.in_(LIVE_STATES)).exists())
         .values(released_at=bindparam("at")))
_PG_LICENCE_LOCK = 0x76677075  # "vgpu": one advisory lock key for seat hand-outs


def _reuse_or_take(session: Session, vm: Vm, gpu: Gpu | None, editions: list[str],
                   today: date) -> LicenceLease | None:
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LICENCE_LOCK})")
    params = {f"e{i}": editions[min(i, len(editions) - 1)] for i in range(len(EDITIONS))}  # padded
    rows = conn.execute(_POOL_STATS, {"vm_id": vm.id, "gpu_id": gpu.id if gpu is not None else -1,
                                      "today": today, "has_gpu": gpu is not None, **params}).all()
    # Cheapest edition first; among equals the pool expiring soonest, so long-lived seats stay free.
    rows.sort(key=lambda r: (EDITION_COST[r.edition], r.expires or date.max, r.id))
    for row in rows:
        if row.reusable is not None:
            return session.get(LicenceLease, row.reusable)
    for row in rows:
        if row.used < row.seats:
            pool = _detached(LicencePool(**{c.key: row._mapping[c.key] for c in _P.c}))
            values = {"pool_id": pool.id, "host_id": vm.host_id, "vm_id": vm.id,
                      "gpu_id": gpu.id if gpu is not None and pool.unit == UNIT_GPU else None,
                      "holder": _holder(vm, gpu, pool.unit), "acquired_at": utcnow(), "released_at": None}
            lease_id = conn.execute(_INSERT_LEASE, values).scalar_one()
            lease = _detached(LicenceLease(id=lease_id, **values))
            set_committed_value(lease, "pool", pool)
            return lease
    return None


def share(session: Session, allocation: Allocation, lease_id: int) -> bool:
    """Link `allocation` to the held seat `lease_id` instead of taking one (a VM migrating in on a database
    it shares with its source keeps its seat: no second seat from a full pool). False when that seat is no
    longer held (then the caller takes a seat as usual)."""
    conn = session.connection()
    held = conn.execute(select(_L.c.id).where(_L.c.id == lease_id, _L.c.released_at.is_(None))).first()
    if held is None:
        return False
    conn.execute(_LINK, {"aid": allocation.id, "lid": lease_id})
    set_committed_value(allocation, "lease_id", lease_id)
    return True


def move(session: Session, lease_id: int, vm: Vm, gpu: Gpu | None) -> bool:
    """The seat now belongs to `vm` (the migrated VM's row on its new host): the same row, so the pool's
    count does not change. False when the VM holds another seat of that pool already (it keeps both until
    the source's allocations are released, which frees the old one)."""
    lease = session.get(LicenceLease, lease_id)
    if lease is None or lease.released_at is not None:
        return False
    holder = _holder(vm, gpu, lease.pool.unit)
    clash = session.scalar(select(_L.c.id).where(_L.c.pool_id == lease.pool_id, _L.c.holder == holder,
                                                 _L.c.released_at.is_(None), _L.c.id != lease_id))
    if clash is not None:
        return False
    session.execute(update(_L).where(_L.c.id == lease_id).values(
        host_id=vm.host_id, vm_id=vm.id, holder=holder,
        gpu_id=gpu.id if gpu is not None and lease.pool.unit == UNIT_GPU else None))
    session.expire(lease)
    return True


def _detached(obj: T) -> T:
    make_transient_to_detached(obj)
    return obj


def release(session: Session, allocation: Allocation, at: datetime | None = None) -> int | None:
    """Give back the allocation's seat unless another live allocation still uses it. Call it after the
    allocation is marked released (store.release does both). Returns the freed lease's id, if any."""
    lease_id = allocation.lease_id
    if lease_id is None:
        return None
    session.flush()  # ORM-side changes to other allocations must be visible to the check below
    freed = session.connection().execute(_FREE, {"lid": lease_id, "at": at or utcnow()}).rowcount
    return lease_id if freed else None


def release_vm(session: Session, vm: Vm, at: datetime | None = None) -> list[LicenceLease]:
    """Free every seat a VM holds (the VM is gone)."""
    leases = session.scalars(select(LicenceLease).where(LicenceLease.vm_id == vm.id,
                                                        LicenceLease.released_at.is_(None))).all()
    for lease in leases:
        lease.released_at = at or utcnow()
    return list(leases)


# -- usage -------------------------------------------------------------------------------------------

@dataclass
class Holder:
    pool: str
    edition: str
    unit: str
    host: str
    vm: str
    gpu: str | None
    since: datetime

    def to_json(self) -> dict[str, object]:
        return {"pool": self.pool, "edition": self.edition, "unit": self.unit, "host": self.host,
                "vm": self.vm, "gpu": self.gpu, "since": self.since.isoformat()}


@dataclass
class PoolUsage:
    name: str
    edition: str
    unit: str
    seats: int
    used: int
    expires: date | None
    expired: bool

    @property
    def free(self) -> int:
        return 0 if self.expired else max(self.seats - self.used, 0)

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "edition": self.edition, "unit": self.unit, "seats": self.seats,
                "used": self.used, "free": self.free, "expired": self.expired,
                "expires": self.expires.isoformat() if self.expires else None}


@dataclass
class EditionUsage:
    edition: str
    pools: list[PoolUsage] = field(default_factory=list)
    holders: list[Holder] = field(default_factory=list)

    @property
    def seats(self) -> int:
        """Seats in pools that have not expired."""
        return sum(p.seats for p in self.pools if not p.expired)

    @property
    def used(self) -> int:
        return sum(p.used for p in self.pools)

    @property
    def free(self) -> int:
        return sum(p.free for p in self.pools)

    def to_json(self) -> dict[str, object]:
        return {"edition": self.edition, "seats": self.seats, "used": self.used, "free": self.free,
                "pools": [p.to_json() for p in self.pools], "holders": [h.to_json() for h in self.holders]}


def usage(session: Session, today: date | None = None) -> list[EditionUsage]:
    """Seats, use and holders per edition (editions without pools are left out)."""
    day = _today(today)
    by_edition: dict[str, EditionUsage] = {}
    used: dict[int, int] = {}
    rows = session.execute(
        select(LicenceLease.pool_id, LicenceLease.acquired_at, Host.name, Vm.name, Gpu.address)
        .join(Host, Host.id == LicenceLease.host_id).join(Vm, Vm.id == LicenceLease.vm_id)
        .outerjoin(Gpu, Gpu.id == LicenceLease.gpu_id)
        .where(LicenceLease.released_at.is_(None))
        .order_by(LicenceLease.acquired_at)).all()
    pools = {p.id: p for p in list_pools(session)}
    for pool in pools.values():
        by_edition.setdefault(pool.edition, EditionUsage(pool.edition))
    holders: dict[int, list[Holder]] = {}
    for pool_id, since, host_name, vm_name, gpu_address in rows:
        pool = pools[pool_id]
        used[pool_id] = used.get(pool_id, 0) + 1
        holders.setdefault(pool_id, []).append(
            Holder(pool.name, pool.edition, pool.unit, host_name, vm_name, gpu_address, since))
    for pool in pools.values():
        eu = by_edition[pool.edition]
        eu.pools.append(PoolUsage(pool.name, pool.edition, pool.unit, pool.seats, used.get(pool.id, 0),
                                  pool.expires, pool.expired(day)))
        eu.holders.extend(holders.get(pool.id, []))
    return [by_edition[e] for e in EDITIONS if e in by_edition]


def leases(session: Session, *, vm: Vm | None = None, held: bool = True) -> list[LicenceLease]:
    # Seats are freed with Core UPDATEs; never answer from stale objects in the identity map.
    stmt = select(LicenceLease).order_by(LicenceLease.id).execution_options(populate_existing=True)
    if vm is not None:
        stmt = stmt.where(LicenceLease.vm_id == vm.id)
    if held:
        stmt = stmt.where(LicenceLease.released_at.is_(None))
    return list(session.scalars(stmt).unique())
