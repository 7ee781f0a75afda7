"""The small repository API the service uses. Every function works inside the caller's Session and
transaction and never commits: the service decides what goes together (change + audit event).

Host-local functions take the host as a Host row or its id.

Long because: it is the one repository API over every table the service writes (hosts, GPUs, types, VMs,
allocations with their owners), with the hot path's statements built once at import next to them.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, make_transient_to_detached
from sqlalchemy.orm.attributes import set_committed_value

from vgpumgr import ids
from vgpumgr.db.models import (
    ALLOC_ACTIVE,
    ALLOC_RELEASED,
    ALLOC_RESERVED,
    ALLOC_STATES,
    LIVE_STATES,
    Allocation,
    Gpu,
    Host,
    LicenceLease,
    LicencePool,
    VgpuTypeEntry,
    Vm,
    utcnow,
)
from vgpumgr.db.prepared import Prepared
from vgpumgr.errors import Conflict, InvalidInput
from vgpumgr.licensing import seats as licensing
from vgpumgr.model import BACKEND_MDEV, BACKEND_MIG, BACKEND_NVIDIA_VF, BACKEND_PASSTHROUGH, BACKEND_VF

BACKENDS = (BACKEND_MDEV, BACKEND_NVIDIA_VF, BACKEND_PASSTHROUGH, BACKEND_MIG, BACKEND_VF)
PASSTHROUGH_TYPE = "passthrough"


def _id(row_or_id: Any) -> int:
    return row_or_id if isinstance(row_or_id, int) else row_or_id.id


def _insert_ignore(session: Session, model: type, values: dict[str, Any], keys: list[str]) -> None:
    """INSERT that does nothing if the unique key exists (two hosts/processes may race on first sight)."""
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    session.execute(insert(model).values(**values).on_conflict_do_nothing(index_elements=keys))


# -- hosts, GPUs, types, VMs -------------------------------------------------------------------------

def upsert_host(session: Session, name: str) -> Host:
    if not name or len(name) > 255:
        raise InvalidInput(f"'{name}' is not a usable host name", hint="use the machine's hostname")
    from vgpumgr.db import schema

    host = session.scalar(select(Host).where(Host.name == name))
    if host is None:
        now = utcnow()
        _insert_ignore(session, Host, {"name": name, "created_at": now, "last_seen": now}, ["name"])
        host = session.scalars(select(Host).where(Host.name == name)).one()
    else:
        host.last_seen = utcnow()
    # what this host runs, for rolling upgrades (`db upgrade --contract` refuses while old code is live)
    version, known = schema.code_version(), schema.code_ordinal()
    if host.code_version != version or host.code_schema != known:
        host.code_version, host.code_schema = version, known
    return host


def get_host(session: Session, name: str) -> Host | None:
    return session.scalar(select(Host).where(Host.name == name))


def upsert_gpu(session: Session, host: Host | int, address: str, *, model: str = "", uuid: str | None = None,
               serial: str | None = None, vendor_id: str | None = None, device_id: str | None = None) -> Gpu:
    """Record a physical GPU; known facts (UUID, serial) are kept when a later scan lacks them."""
    address = ids.pci_address(address)
    host_id = _id(host)
    gpu = gpu_by_address(session, host_id, address)
    now = utcnow()
    if gpu is None:
        _insert_ignore(session, Gpu, {"host_id": host_id, "address": address, "model": model, "uuid": uuid,
                                      "serial": serial, "vendor_id": vendor_id, "device_id": device_id,
                                      "first_seen": now, "last_seen": now}, ["host_id", "address"])
        return session.scalars(select(Gpu).where(Gpu.host_id == host_id, Gpu.address == address)).one()
    gpu.last_seen = now
    gpu.model = model or gpu.model
    gpu.uuid = uuid or gpu.uuid
    gpu.serial = serial or gpu.serial
    gpu.vendor_id = vendor_id or gpu.vendor_id
    gpu.device_id = device_id or gpu.device_id
    return gpu


def gpu_by_address(session: Session, host: Host | int, address: str) -> Gpu | None:
    address = ids.pci_address(address)
    return session.scalar(select(Gpu).where(Gpu.host_id == _id(host), Gpu.address == address))


def gpus(session: Session, host: Host | int) -> list[Gpu]:
    return list(session.scalars(select(Gpu).where(Gpu.host_id == _id(host)).order_by(Gpu.address)).unique())


def upsert_vgpu_type(session: Session, host: Host | int, *, gpu_model: str, type_id: str, name: str,
                     backend: str, series: str | None = None, framebuffer_mb: int | None = None,
                     max_instances: int | None = None, mig_slices: int | None = None) -> VgpuTypeEntry:
    type_id = ids.type_dir(type_id)
    host_id = _id(host)
    stmt = select(VgpuTypeEntry).where(VgpuTypeEntry.host_id == host_id, VgpuTypeEntry.gpu_model == gpu_model,
                                       VgpuTypeEntry.type_id == type_id)
    entry = session.scalar(stmt)
    facts = {"name": name, "backend": backend, "series": series, "framebuffer_mb": framebuffer_mb,
             "max_instances": max_instances, "mig_slices": mig_slices}
    if entry is None:
        key = {"host_id": host_id, "gpu_model": gpu_model, "type_id": type_id}
        _insert_ignore(session, VgpuTypeEntry, {**key, "updated_at": utcnow(), **facts}, list(key))
        return session.scalars(stmt).one()
    for key, value in facts.items():
        setattr(entry, key, value)
    return entry


def vgpu_types(session: Session, host: Host | int, gpu_model: str | None = None) -> list[VgpuTypeEntry]:
    stmt = select(VgpuTypeEntry).where(VgpuTypeEntry.host_id == _id(host))
    if gpu_model is not None:
        stmt = stmt.where(VgpuTypeEntry.gpu_model == gpu_model)
    return list(session.scalars(stmt.order_by(VgpuTypeEntry.gpu_model, VgpuTypeEntry.type_id)))


def upsert_vm(session: Session, host: Host | int, name: str, *, uuid: str | None = None,
              state: str | None = None) -> Vm:
    name = ids.vm_name(name)
    if uuid is not None:
        uuid = ids.mdev_uuid(uuid)  # same 8-4-4-4-12 form as libvirt's domain UUID
    host_id = _id(host)
    vm = get_vm(session, host_id, name)
    if vm is None:
        now = utcnow()
        _insert_ignore(session, Vm, {"host_id": host_id, "name": name, "uuid": uuid,
                                     "state": state or "defined", "created_at": now, "updated_at": now},
                       ["host_id", "name"])
        return session.scalars(select(Vm).where(Vm.host_id == host_id, Vm.name == name)).one()
    if uuid is not None:
        vm.uuid = uuid
    if state is not None:
        vm.state = state
    return vm


def vm_ref(session: Session, host: Host | int, name: str) -> Any:
    """The VM's id, name and host_id (its row made if missing) for an allocation and its licence seat: a Core
    row, no ORM object (an ORM load cost ~0.5 ms of a REST allocation)."""
    name = ids.vm_name(name)
    conn = session.connection()
    params = {"host_id": _id(host), "name": name}
    row = conn.execute(_VM_REF, params).first()
    if row is None:
        now = utcnow()
        _insert_ignore(session, Vm, {**params, "uuid": None, "state": "defined", "created_at": now,
                                     "updated_at": now}, ["host_id", "name"])
        row = conn.execute(_VM_REF, params).one()
    return row


def get_vm(session: Session, host: Host | int, name: str) -> Vm | None:
    return session.scalar(select(Vm).where(Vm.host_id == _id(host), Vm.name == name))


def vms(session: Session, host: Host | int) -> list[Vm]:
    return list(session.scalars(select(Vm).where(Vm.host_id == _id(host)).order_by(Vm.name)))


# -- allocations -------------------------------------------------------------------------------------

_ALLOC = Allocation.__table__
_VM_REF = (select(Vm.__table__.c.id, Vm.__table__.c.name, Vm.__table__.c.host_id)
           .where(Vm.__table__.c.host_id == bindparam("host_id"), Vm.__table__.c.name == bindparam("name")))


# ON CONFLICT DO NOTHING covers every unique index, partial ones included, without aborting the
# transaction (PostgreSQL) and without a savepoint round trip. Built once: statement construction
# costs more than executing it.
OWNER_COLUMNS = ("owner_host", "owner_boot", "owner_pid", "owner_started", "lease_until")
NO_OWNER: dict[str, Any] = dict.fromkeys(OWNER_COLUMNS)
_RESERVE_COLUMNS = ("host_id", "backend", "parent", "type_id", "uuid", "pci_address", "gpu_id", "vm_id", "lease_id",
                    "type_name", "series", "idempotency_key", "detail", "state", "created_at", "activated_at",
                    "released_at", *OWNER_COLUMNS)
_RESERVE = {
    "postgresql": Prepared(postgresql.insert(_ALLOC).on_conflict_do_nothing().returning(_ALLOC.c.id),
                           _RESERVE_COLUMNS),
    "sqlite": Prepared(sqlite.insert(_ALLOC).on_conflict_do_nothing().returning(_ALLOC.c.id), _RESERVE_COLUMNS),
}
_BY_KEY = select(_ALLOC).where(_ALLOC.c.host_id == bindparam("host_id"), _ALLOC.c.idempotency_key == bindparam("key"))


def detached(row: Any) -> Allocation:  # an Allocation from a Core row of its columns (extra labels ignored)
    return _detached(Allocation(**{c: row._mapping[c] for c in _ALLOC.c.keys()}))


def _detached(obj: Any) -> Any:
    """A row written with Core, as an ORM object a session can adopt with add() (no second INSERT)."""
    make_transient_to_detached(obj)
    return obj


def reserve_allocation(session: Session, host: Host | int, *, backend: str, parent: str, type_id: str,
                       uuid: str | None = None, pci_address: str | None = None, gpu: Gpu | int | None = None,
                       vm: Vm | int | None = None, type_name: str | None = None, series: str | None = None,
                       idempotency_key: str | None = None, detail: dict[str, Any] | None = None,
                       lease: LicenceLease | int | None = None, owner: dict[str, Any] | None = None
                       ) -> Allocation:
    """Write a `reserved` allocation (one INSERT). The database refuses a second live allocation of the
    same mdev UUID or PCI function, and a reused idempotency key; both surface as Conflict, and the
    caller's transaction stays usable. `lease`: the seat licensing.acquire() took for it. `owner`: the
    reservation's owner columns (see `owner_values`), so a crash before activation can be rolled back."""
    if backend not in BACKENDS:
        raise InvalidInput(f"backend '{backend}' is unknown", hint=f"use one of {', '.join(BACKENDS)}")
    parent = ids.parent_name(parent)
    if type_id != PASSTHROUGH_TYPE:
        type_id = ids.type_dir(type_id)
    uuid = ids.mdev_uuid(uuid) if uuid is not None else None
    pci_address = ids.pci_address(pci_address) if pci_address is not None else None
    if backend == BACKEND_MDEV and uuid is None:
        raise InvalidInput("an mdev allocation needs the mdev UUID")
    if backend in (BACKEND_NVIDIA_VF, BACKEND_PASSTHROUGH) and pci_address is None:
        raise InvalidInput(f"a {backend} allocation needs the PCI address of the function given to the VM")
    if idempotency_key is not None and not 0 < len(idempotency_key) <= 128:
        raise InvalidInput("an idempotency key must be 1-128 characters")
    values = {"host_id": _id(host), "backend": backend, "parent": parent, "type_id": type_id, "uuid": uuid,
              "pci_address": pci_address, "gpu_id": None if gpu is None else _id(gpu),
              "vm_id": None if vm is None else _id(vm), "lease_id": None if lease is None else _id(lease),
              "type_name": type_name, "series": series, "idempotency_key": idempotency_key, "detail": detail,
              "state": ALLOC_RESERVED, "created_at": utcnow(), "activated_at": None, "released_at": None,
              **(owner or NO_OWNER)}
    conn = session.connection()
    inserted = _RESERVE[conn.dialect.name].execute(conn, values).fetchone()
    new_id = inserted[0] if inserted else None
    if new_id is None:
        raise _conflict(session, values)
    return _detached(Allocation(id=new_id, **values))


def _conflict(session: Session, v: dict[str, Any]) -> Conflict:
    key = v["idempotency_key"]
    if key is not None and find_by_idempotency_key(session, v["host_id"], key) is not None:
        return Conflict(f"idempotency key '{key}' was already used on this host",
                        hint="look the earlier request up by its key instead of repeating it",
                        idempotency_key=key)
    if v["uuid"] is not None and live_allocation(session, v["host_id"], uuid=v["uuid"]) is not None:
        return Conflict(f"vGPU {v['uuid']} is already allocated",
                        hint="release it first, or omit the UUID to get a new one", uuid=v["uuid"])
    address = v["pci_address"]
    return Conflict(f"PCI function {address} is already allocated",
                    hint="release it first, or let placement choose another function", pci_address=address)


_ACTIVATE_STMT = (update(_ALLOC).where(_ALLOC.c.id == bindparam("aid"), _ALLOC.c.state == ALLOC_RESERVED)
                  .values(state=ALLOC_ACTIVE, activated_at=bindparam("at")))
_ACTIVATE = Prepared(_ACTIVATE_STMT)
_ACTIVATE_DONE = Prepared(_ACTIVATE_STMT.values(**NO_OWNER))
_RELEASE = Prepared(update(_ALLOC).where(_ALLOC.c.id == bindparam("aid"), _ALLOC.c.state != ALLOC_RELEASED)
                    .values(state=ALLOC_RELEASED, released_at=bindparam("at"), **NO_OWNER))
_IN_FLIGHT = (select(_ALLOC.c.id, _ALLOC.c.state, *(_ALLOC.c[c] for c in OWNER_COLUMNS))
              .where(_ALLOC.c.host_id == bindparam("host_id"),
                     (_ALLOC.c.owner_pid.is_not(None)) | (_ALLOC.c.state == ALLOC_RESERVED))
              .order_by(_ALLOC.c.id))


def activate(session: Session, allocation: Allocation, at: datetime | None = None, keep_owner: bool = False
             ) -> Allocation:
    """reserved -> active (the device exists and is attached). Activating twice is harmless.

    The reservation's owner is cleared with it, unless `keep_owner` (the operation goes on: a VM is still
    to be defined around it); then `clear_owner` ends it."""
    if allocation.state == ALLOC_RELEASED:
        raise Conflict(f"allocation {_describe(allocation)} was already released",
                       hint="reserve a new allocation instead")
    if allocation.state == ALLOC_RESERVED:
        at = at or utcnow()
        (_ACTIVATE if keep_owner else _ACTIVATE_DONE).execute(session.connection(), {"aid": allocation.id, "at": at})
        set_committed_value(allocation, "state", ALLOC_ACTIVE)
        set_committed_value(allocation, "activated_at", at)
        if not keep_owner:
            for c in OWNER_COLUMNS:
                set_committed_value(allocation, c, None)
    return allocation


def is_in_flight(row: Any) -> bool:
    """Whether a row of `live_rows` is one `in_flight` returns: owned by an operation, or still reserved."""
    return row.owner_pid is not None or row.state == ALLOC_RESERVED


def in_flight(session: Session, host: Host | int) -> list[Any]:
    """Rows some operation still owns, and `reserved` rows (with or without an owner): one indexed query.
    Core rows with id, state and the owner columns."""
    return list(session.connection().execute(_IN_FLIGHT, {"host_id": _id(host)}))


def set_owner(session: Session, allocation_ids: Iterable[int], owner: dict[str, Any]) -> None:
    """Tie live allocations to an operation in flight (e.g. `vm delete` between undefine and release)."""
    ids_ = list(allocation_ids)
    if ids_:
        session.execute(update(_ALLOC).where(_ALLOC.c.id.in_(ids_), _ALLOC.c.state != ALLOC_RELEASED)
                        .values(**owner))


def clear_owner(session: Session, allocation_ids: Iterable[int]) -> None:
    """The operation that owned these allocations finished: they are plain live records again."""
    ids_ = list(allocation_ids)
    if ids_:
        session.execute(update(_ALLOC).where(_ALLOC.c.id.in_(ids_)).values(**NO_OWNER))


def forget_idempotency_key(session: Session, allocation_id: int) -> None:
    """A rolled-back allocation did not use up its request's key: a retry of that request may allocate."""
    session.execute(update(_ALLOC).where(_ALLOC.c.id == allocation_id).values(idempotency_key=None))


def release(session: Session, allocation: Allocation, at: datetime | None = None) -> Allocation:
    """-> released, freeing its licence seat if nothing else of the VM uses it. Idempotent."""
    if allocation.state == ALLOC_RELEASED:
        return allocation
    at = at or utcnow()
    _RELEASE.execute(session.connection(), {"aid": allocation.id, "at": at})
    set_committed_value(allocation, "state", ALLOC_RELEASED)
    set_committed_value(allocation, "released_at", at)
    licensing.release(session, allocation, at)
    return allocation


def release_live(session: Session, allocation: Allocation, at: datetime | None = None) -> bool:
    """`release` of a row read earlier: False (nothing changed) when another release got there first."""
    at = at or utcnow()
    if _RELEASE.execute(session.connection(), {"aid": allocation.id, "at": at}).rowcount != 1:
        return False
    set_committed_value(allocation, "state", ALLOC_RELEASED)
    set_committed_value(allocation, "released_at", at)
    licensing.release(session, allocation, at)
    return True


def _describe(allocation: Allocation) -> str:
    return allocation.uuid or allocation.pci_address or f"#{allocation.id}"


def find_by_idempotency_key(session: Session, host: Host | int, key: str) -> Allocation | None:
    """The allocation a request with this key made earlier (a detached object; Core, for speed)."""
    row = session.connection().execute(_BY_KEY, {"host_id": _id(host), "key": key}).first()
    return None if row is None else _detached(Allocation(**row._mapping))


_VMS = Vm.__table__
_LIVE_BY = {
    column: select(_ALLOC, _VMS.c.name.label("vm_name"))
    .select_from(_ALLOC.outerjoin(_VMS, _VMS.c.id == _ALLOC.c.vm_id))
    .where(_ALLOC.c.host_id == bindparam("host_id"), _ALLOC.c.state.in_(LIVE_STATES),
           _ALLOC.c[column] == bindparam("ref"))
    for column in ("uuid", "pci_address")
}
_LIVE_COLUMNS = ("id", "state", "backend", "parent", "pci_address", "uuid", "type_id", "type_name", "detail",
                 *OWNER_COLUMNS)
_LIVE_ROWS = (select(*(_ALLOC.c[c] for c in _LIVE_COLUMNS), _VMS.c.name.label("vm_name"))
              .select_from(_ALLOC.outerjoin(_VMS, _VMS.c.id == _ALLOC.c.vm_id))
              .where(_ALLOC.c.host_id == bindparam("host_id"), _ALLOC.c.state.in_(LIVE_STATES))
              .order_by(_ALLOC.c.id))


_LEASES = LicenceLease.__table__
_POOLS = LicencePool.__table__
_SEATED_ROWS = (select(_ALLOC.c.id, _ALLOC.c.backend, _ALLOC.c.parent, _ALLOC.c.pci_address, _ALLOC.c.uuid,
                       _ALLOC.c.type_id, _ALLOC.c.type_name, _ALLOC.c.series, _ALLOC.c.detail, _ALLOC.c.activated_at,
                       _VMS.c.name.label("vm_name"), _POOLS.c.edition.label("edition"))
                .select_from(_ALLOC.outerjoin(_VMS, _VMS.c.id == _ALLOC.c.vm_id)
                             .outerjoin(_LEASES, _LEASES.c.id == _ALLOC.c.lease_id)
                             .outerjoin(_POOLS, _POOLS.c.id == _LEASES.c.pool_id))
                .where(_ALLOC.c.host_id == bindparam("host_id"), _ALLOC.c.state.in_(LIVE_STATES)))


def seated_rows(session: Session, host: Host | int) -> list[Any]:
    """Every live allocation with its VM's name and its seat's edition: one query (telemetry's join)."""
    return list(session.connection().execute(_SEATED_ROWS, {"host_id": _id(host)}))


def live_rows(session: Session, host: Host | int) -> list[Any]:
    """Every live allocation (passthrough too) with its state, owner columns and VM name: one query that
    serves both the dead-owner check and placement (Core rows)."""
    return list(session.connection().execute(_LIVE_ROWS, {"host_id": _id(host)}))


def live_allocation(session: Session, host: Host | int, *, uuid: str | None = None,
                    pci_address: str | None = None) -> Allocation | None:
    """The reserved/active allocation that holds an mdev UUID or a PCI function, if any."""
    stmt = select(Allocation).where(Allocation.host_id == _id(host), Allocation.state.in_(LIVE_STATES))
    if uuid is not None:
        stmt = stmt.where(Allocation.uuid == ids.mdev_uuid(uuid))
    elif pci_address is not None:
        stmt = stmt.where(Allocation.pci_address == ids.pci_address(pci_address))
    else:
        raise InvalidInput("give a UUID or a PCI address")
    return session.scalar(stmt)


def live_allocation_row(session: Session, host: Host | int, *, uuid: str | None = None,
                        pci_address: str | None = None) -> Any:
    """The live allocation's row (every column and `vm_name`; `detached(row)` for an Allocation) or None."""
    if uuid is not None:
        column, ref = "uuid", ids.mdev_uuid(uuid)
    elif pci_address is not None:
        column, ref = "pci_address", ids.pci_address(pci_address)
    else:
        raise InvalidInput("give a UUID or a PCI address")
    return session.connection().execute(_LIVE_BY[column], {"host_id": _id(host), "ref": ref}).first()


def allocations(session: Session, host: Host | int | None = None, *, vm: Vm | str | None = None,
                gpu: Gpu | str | None = None, state: str | Iterable[str] | None = None,
                live: bool | None = None, backend: str | None = None, parent: str | None = None
                ) -> list[Allocation]:
    """Filtered allocations, oldest first. `vm` by row or name, `gpu` by row or PCI address;
    `live=True` means reserved or active."""
    stmt = select(Allocation)
    if host is not None:
        stmt = stmt.where(Allocation.host_id == _id(host))
    if isinstance(vm, Vm):
        stmt = stmt.where(Allocation.vm_id == vm.id)
    elif vm is not None:
        stmt = stmt.join(Vm, Vm.id == Allocation.vm_id).where(Vm.name == vm)
    if isinstance(gpu, Gpu):
        stmt = stmt.where(Allocation.gpu_id == gpu.id)
    elif gpu is not None:
        stmt = stmt.join(Gpu, Gpu.id == Allocation.gpu_id).where(Gpu.address == ids.pci_address(gpu))
    if state is not None:
        states = [state] if isinstance(state, str) else list(state)
        unknown = set(states) - set(ALLOC_STATES)
        if unknown:
            raise InvalidInput(f"unknown allocation state(s): {', '.join(sorted(unknown))}",
                               hint=f"use {', '.join(ALLOC_STATES)}")
        stmt = stmt.where(Allocation.state.in_(states))
    if live is not None:
        stmt = stmt.where(Allocation.state.in_(LIVE_STATES) if live else Allocation.state == ALLOC_RELEASED)
    if backend is not None:
        stmt = stmt.where(Allocation.backend == backend)
    if parent is not None:
        stmt = stmt.where(Allocation.parent == parent)
    return list(session.scalars(stmt.order_by(Allocation.id)))


def leases(session: Session, *, vm: Vm | None = None, held: bool = True) -> list[LicenceLease]:
    return licensing.leases(session, vm=vm, held=held)
