"""The only place that changes the world: lock -> place -> reserve -> create -> activate, or roll back.

The CLI, the REST API, the hooks and the demo all call this module; nothing else writes to sysfs,
the database or libvirt on their behalf. Every change is an audit event in the same transaction as
the record it describes.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, object_session

from vgpumgr import audit, ids, licensing
from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.backends import nvidia_vf
from vgpumgr.config import Config
from vgpumgr.db import store
from vgpumgr.db.models import Allocation as AllocRow
from vgpumgr.db.models import Vm
from vgpumgr.db.session import session_factory, upgrade
from vgpumgr.errors import Conflict, InvalidInput, NoCapacity, NotFound, VgpuError
from vgpumgr.inventory import scan
from vgpumgr.locking import host_lock
from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF, BACKEND_PASSTHROUGH, Inventory
from vgpumgr.placement import Allocation as PlacedAlloc
from vgpumgr.placement import Decision, Placer, Policy, Request

OK, FAILED, WARNING = "ok", "failed", "warning"
NVIDIA_TEARDOWN_GRACE = 10.0  # seconds NVIDIA's driver may take to remove an mdev itself after QEMU exits
_schema_ready: set[str] = set()
_schema_lock = threading.Lock()


def hostname() -> str:
    return os.environ.get("VGPUMGR_HOSTNAME") or socket.gethostname()


def ensure_schema(url: str) -> None:
    with _schema_lock:
        if url not in _schema_ready:
            upgrade(url)
            _schema_ready.add(url)


@dataclass
class Snapshot:
    inventory: Inventory
    placer: Placer
    taken: float = field(default_factory=time.monotonic)


class Service:
    def __init__(self, cfg: Config, licence_mode: str | None = None, snapshot_ttl: float = 5.0) -> None:
        self.cfg = cfg
        self.host = cfg.host
        self.hostname = hostname()
        self.licence_mode = licensing.check_mode(licence_mode or os.environ.get("VGPUMGR_LICENCE_MODE", "warn"))
        ensure_schema(cfg.db_url)
        self.sessions = session_factory(cfg.db_url)
        self.lock_path = cfg.state_dir / "vgpumgr.lock"
        self.snapshot_ttl = snapshot_ttl
        self._snapshot: Snapshot | None = None
        self._snap_lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------------------
    @contextmanager
    def tx(self) -> Iterator[Session]:
        with self.sessions.begin() as s:
            yield s

    @contextmanager
    def locked(self, timeout: float = 30.0) -> Iterator[None]:
        with host_lock(self.lock_path, timeout=timeout):
            yield

    def _db_host(self, s: Session):  # noqa: ANN202
        return store.upsert_host(s, self.hostname)

    def event(self, s: Session, action: str, outcome: str = OK, *, actor: str | None = None, **kw: Any) -> None:
        audit.append(s, actor=actor or self.cfg.actor, action=action, outcome=outcome, host=self.hostname, **kw)

    def record_failure(self, action: str, error: BaseException, *, actor: str | None = None, **kw: Any) -> None:
        with self.tx() as s:
            self.event(s, action, FAILED, actor=actor, error=str(error), **kw)

    def snapshot(self, refresh: bool = False) -> Snapshot:
        with self._snap_lock:
            snap = self._snapshot
            if refresh or snap is None or time.monotonic() - snap.taken > self.snapshot_ttl:
                inv = scan(self.host)
                self._merge_nvml(inv)
                snap = self._snapshot = Snapshot(inv, Placer(inv))
            return snap

    def invalidate(self) -> None:
        with self._snap_lock:
            self._snapshot = None

    def _merge_nvml(self, inv: Inventory) -> None:
        try:
            from vgpumgr.nvml_facts import merge_nvml
        except ImportError:
            return
        merge_nvml(self.cfg, inv.gpus, quiet=True)

    # -- records -> placement inputs ------------------------------------------------------------
    def _live_records(self, s: Session) -> list[PlacedAlloc]:
        h = self._db_host(s)
        names = {v.id: v.name for v in store.vms(s, h)}
        out = []
        for a in store.allocations(s, h, live=True):
            if a.backend == BACKEND_PASSTHROUGH:
                continue
            d = a.detail or {}
            out.append(PlacedAlloc(gpu=d.get("gpu"), parent=a.pci_address if a.backend == BACKEND_NVIDIA_VF else a.parent,
                                   type=a.type_id, framebuffer_mb=d.get("framebuffer_mb"), vm=names.get(a.vm_id),
                                   backend=a.backend, id=a.uuid or a.pci_address or "", name=a.type_name))
        return out

    # -- placement ------------------------------------------------------------------------------
    def place(self, type_name: str, vm: str | None = None, policy: Policy | None = None,
              free_gpu_instances: dict[str, list[str]] | None = None) -> Decision:
        """What placement would choose now, changing nothing."""
        snap = self.snapshot()
        with self.sessions() as s:
            records = self._live_records(s)
        return snap.placer.place(records, Request(type_name, vm), policy or Policy(),
                                 free_gpu_instances=free_gpu_instances)

    # -- allocate / release ---------------------------------------------------------------------
    def allocate(self, type_name: str, *, vm: str | None = None, policy: Policy | None = None,
                 idempotency_key: str | None = None, uuid: str | None = None, actor: str | None = None,
                 detail: dict[str, Any] | None = None) -> dict[str, Any]:
        """Place and create one vGPU. A retried request with the same idempotency key gets the same vGPU."""
        uuid = ids.mdev_uuid(uuid) if uuid else None
        vm = ids.vm_name(vm) if vm else None
        policy = policy or Policy()
        with self.locked():
            if idempotency_key:
                found = self._by_key(idempotency_key)
                if found is not None:
                    return found
            decision = self._decide(type_name, vm, policy)
            c = decision.choice
            if c is None:
                err = NoCapacity(f"no GPU can take a {type_name} vGPU now: {decision.summary()}",
                                 hint="`vgpumgr place --type ... --explain` shows why each candidate was refused",
                                 rejected=[r.__dict__ for r in decision.rejected][:20])
                self.record_failure(audit.PLACEMENT, err, actor=actor, vm=vm,
                                    detail={"type": type_name, "policy": policy.__dict__ if policy else None})
                raise err
            inv = self.snapshot().inventory
            t = next((t for t in inv.types_of(c.parent) if t.type == c.type), None)
            parsed = ids.parse_type_name(c.name or "")
            fb = t.framebuffer_mb if t and t.framebuffer_mb else (int(parsed.framebuffer_gb * 1024) if parsed else None)
            series = t.series if t and t.series else (parsed.series if parsed else None)
            new_uuid = (uuid or ids.new_uuid()) if c.backend == BACKEND_MDEV else None
            g = inv.gpu(c.gpu) if c.gpu else None
            with self.tx() as s:
                h = self._db_host(s)
                gpu_row = store.upsert_gpu(s, h, c.gpu, model=g.name if g else "") if c.gpu else None
                vm_row = store.upsert_vm(s, h, vm) if vm else None
                row = store.reserve_allocation(
                    s, h, backend=c.backend, parent=c.parent, type_id=c.type, uuid=new_uuid,
                    pci_address=c.parent if c.backend == BACKEND_NVIDIA_VF else None, gpu=gpu_row, vm=vm_row,
                    type_name=c.name, series=series, idempotency_key=idempotency_key,
                    detail={"framebuffer_mb": fb, "gpu": c.gpu, **(detail or {})})
                licensing.acquire(s, vm_row, gpu_row, series, self.licence_mode, allocation=row,
                                  actor=actor or self.cfg.actor, host_name=self.hostname)
                self.event(s, audit.PLACEMENT, actor=actor, gpu=c.gpu, vm=vm, vgpu=new_uuid or c.parent,
                           detail={"type": c.type, "name": c.name, "parent": c.parent, "why": c.why})
                row_id = row.id
            try:
                if c.backend == BACKEND_MDEV:
                    mdev_backend.create(self.host, c.parent, c.type, new_uuid)
                else:
                    nvidia_vf.set_type(self.host, c.parent, c.type)
            except BaseException as e:
                self._rollback_allocation(row_id, e, actor)
                self.invalidate()
                raise
            self._touch(c.parent)
            with self.tx() as s:
                row = s.get(AllocRow, row_id)
                store.activate(s, row)
                self.event(s, audit.VGPU_CREATE, actor=actor, gpu=c.gpu, vm=vm, vgpu=row.uuid or row.pci_address,
                           detail={"type": c.type, "name": c.name, "parent": c.parent, "backend": c.backend})
                return allocation_dict(row)

    def _decide(self, type_name: str, vm: str | None, policy: Policy) -> Decision:
        with self.sessions() as s:
            records = self._live_records(s)
        decision = self.snapshot().placer.place(records, Request(type_name, vm), policy)
        if decision.choice is None and time.monotonic() - self.snapshot().taken > 0.05:
            decision = self.snapshot(refresh=True).placer.place(records, Request(type_name, vm), policy)
        return decision

    def _touch(self, parent: str) -> None:
        """Our own change makes the snapshot stale: take a new one next time."""
        self.invalidate()

    def _by_key(self, key: str) -> dict[str, Any] | None:
        with self.sessions() as s:
            row = store.find_by_idempotency_key(s, self._db_host(s).id, key)
            if row is None:
                return None
            if row.state == "released":
                raise Conflict(f"idempotency key '{key}' belongs to a released vGPU",
                               hint="use a new key for a new request")
            return allocation_dict(row)

    def _rollback_allocation(self, row_id: int, error: BaseException, actor: str | None) -> None:
        with self.tx() as s:
            row = s.get(AllocRow, row_id)
            store.release(s, row)
            self.event(s, audit.VGPU_CREATE, FAILED, actor=actor, gpu=(row.detail or {}).get("gpu"),
                       vm=allocation_dict(row, s)["vm"], vgpu=row.uuid or row.pci_address, error=str(error),
                       detail={"type": row.type_id, "parent": row.parent, "rolled_back": True})

    def allocate_passthrough(self, address: str, *, vm: str | None = None, idempotency_key: str | None = None,
                             actor: str | None = None) -> dict[str, Any]:
        """Record a whole GPU for a VM (libvirt's managed='yes' moves it to vfio-pci at VM start)."""
        address = ids.pci_address(address)
        vm = ids.vm_name(vm) if vm else None
        with self.locked():
            if idempotency_key:
                found = self._by_key(idempotency_key)
                if found is not None:
                    return found
            g = self.snapshot(refresh=True).inventory.gpu(address)
            if g is None:
                raise NotFound(f"no GPU {address}", hint="`vgpumgr gpus` lists the GPUs")
            if "passthrough" not in g.backends:
                raise InvalidInput(f"{address} cannot be passed through",
                                   hint="it needs an IOMMU group and must be a physical function")
            busy = [m for m in self.snapshot().inventory.mdevs if m.gpu == address] + \
                [v for v in self.snapshot().inventory.vf_vgpus if v.gpu == address]
            if busy:
                raise Conflict(f"{address} hosts vGPUs", hint="remove its vGPUs before passing the whole GPU through")
            with self.tx() as s:
                h = self._db_host(s)
                if store.allocations(s, h, live=True, gpu=address):
                    raise Conflict(f"{address} already has vGPUs or a passthrough allocation",
                                   hint="release them first")
                gpu_row = store.upsert_gpu(s, h, address, model=g.name, vendor_id=g.vendor_id, device_id=g.device_id)
                vm_row = store.upsert_vm(s, h, vm) if vm else None
                row = store.reserve_allocation(s, h, backend=BACKEND_PASSTHROUGH, parent=address,
                                               type_id=store.PASSTHROUGH_TYPE, pci_address=address, gpu=gpu_row,
                                               vm=vm_row, type_name=g.name, series=licensing.PASSTHROUGH,
                                               idempotency_key=idempotency_key, detail={"gpu": address})
                licensing.acquire(s, vm_row, gpu_row, licensing.PASSTHROUGH, self.licence_mode, allocation=row,
                                  actor=actor or self.cfg.actor, host_name=self.hostname)
                store.activate(s, row)
                self.event(s, audit.PLACEMENT, actor=actor, gpu=address, vm=vm, vgpu=address,
                           detail={"type": "passthrough", "name": g.name})
                return allocation_dict(row)

    def find_allocation(self, ref: str) -> dict[str, Any]:
        """A live allocation by mdev UUID or PCI address."""
        with self.sessions() as s:
            row = self._live_row(s, ref)
            return allocation_dict(row, s)

    def _live_row(self, s: Session, ref: str) -> AllocRow:
        h = self._db_host(s)
        if ids.is_pci_address(ref):
            row = store.live_allocation(s, h, pci_address=ids.pci_address(ref))
        else:
            row = store.live_allocation(s, h, uuid=ids.mdev_uuid(ref))
        if row is None:
            raise NotFound(f"no live vGPU allocation {ref}", hint="`vgpumgr placements` lists them")
        return row

    def release(self, ref: str, *, actor: str | None = None, grace: float = 0.0) -> dict[str, Any]:
        """Destroy the device of a live allocation and release its record and licence seat."""
        with self.locked():
            with self.sessions() as s:
                row = self._live_row(s, ref)
                row_id, backend = row.id, row.backend
                uuid, address = row.uuid, row.pci_address
                vm_name = allocation_dict(row, s)["vm"]
            holder_check = self._libvirt_holders(skip_vm=None)
            try:
                if backend == BACKEND_MDEV and uuid:
                    mdev_backend.remove(self.host, uuid, grace=grace, holder_check=holder_check("mdev"))
                elif backend == BACKEND_NVIDIA_VF and address:
                    nvidia_vf.clear_type(self.host, address, holder_check=holder_check("pci"),
                                         retries=10 if grace else 3, delay=1.0 if grace else 0.2)
            except VgpuError as e:
                self.record_failure(audit.VGPU_REMOVE, e, actor=actor, vm=vm_name, vgpu=uuid or address)
                raise
            self.invalidate()
            with self.tx() as s:
                row = s.get(AllocRow, row_id)
                store.release(s, row)
                self.event(s, audit.VGPU_REMOVE, actor=actor, gpu=(row.detail or {}).get("gpu"), vm=vm_name,
                           vgpu=uuid or address, detail={"type": row.type_id, "backend": backend})
                return allocation_dict(row)

    def _libvirt_holders(self, skip_vm: str | None):  # noqa: ANN202
        def factory(kind: str):  # noqa: ANN202
            def check(key: str) -> list[str]:
                try:
                    from vgpumgr.virt import Virt

                    v = Virt(self.cfg.libvirt_uri, state_dir=self.cfg.state_dir)
                    names = v.domains_using_mdev(key) if kind == "mdev" else v.domains_using_pci(key)
                    running = [n for n in names if n != skip_vm and v.state(n) in ("running", "paused")]
                    return [f"running libvirt domain {n}" for n in running]
                except VgpuError:
                    return []
            return check
        return factory

    def allocations(self, *, vm: str | None = None, gpu: str | None = None, state: str | None = None,
                    live: bool | None = None) -> list[dict[str, Any]]:
        with self.sessions() as s:
            return [allocation_dict(a, s) for a in store.allocations(s, self._db_host(s), vm=vm, gpu=gpu, state=state,
                                                                   live=live)]


def allocation_dict(a: AllocRow, s: Session | None = None) -> dict[str, Any]:
    detail = a.detail or {}
    vm = None
    if a.vm_id is not None:
        session = s or object_session(a)
        row = session.get(Vm, a.vm_id) if session else None
        vm = row.name if row else None
    return {
        "id": a.id, "uuid": a.uuid, "pci_address": a.pci_address, "backend": a.backend, "parent": a.parent,
        "gpu": detail.get("gpu"), "type": a.type_id,
        "type_name": a.type_name, "series": a.series, "vm": vm,
        "state": a.state, "idempotency_key": a.idempotency_key,
        "licence": a.lease.pool.edition if a.lease_id and a.lease else None,
        "created_at": _iso(a.created_at), "activated_at": _iso(a.activated_at), "released_at": _iso(a.released_at),
    }


def _iso(v: Any) -> str | None:
    return v.isoformat() if v is not None else None


def record_event(cfg: Config, action: str, *, outcome: str = OK, gpu: str | None = None, vm: str | None = None,
                 vgpu: str | None = None, error: str | None = None, detail: dict[str, Any] | None = None) -> None:
    """Audit a change made outside the allocation flow (manual mdev/VF/SR-IOV/vfio commands)."""
    ensure_schema(cfg.db_url)
    with session_factory(cfg.db_url).begin() as s:
        audit.append(s, actor=cfg.actor, action=action, outcome=outcome, host=hostname(), gpu=gpu, vm=vm,
                     vgpu=vgpu, error=error, detail=detail)
