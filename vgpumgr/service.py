"""The only place that changes the world: lock -> place -> reserve -> create -> activate, or roll back.

The CLI, the REST API, the hooks and the demo all call this module; nothing else writes to sysfs,
the database or libvirt on their behalf. Every change is an audit event in the same transaction as
the record it describes.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, object_session

from vgpumgr import audit, checkpoints, ids, licensing
from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.backends import nvidia_vf
from vgpumgr.config import Config
from vgpumgr.db import store
from vgpumgr.db.models import Allocation as AllocRow
from vgpumgr.db.models import Gpu as GpuRow
from vgpumgr.db.models import LicenceLease, Vm
from vgpumgr.db.session import session_factory, upgrade
from vgpumgr.errors import Busy, Conflict, InvalidInput, NoCapacity, NotFound, VgpuError
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
    """Upgrade the schema once per process, and only load Alembic when the database is behind."""
    with _schema_lock:
        if url not in _schema_ready:
            if _stored_revision(url) != _newest_revision():
                upgrade(url)
            _schema_ready.add(url)


def _newest_revision() -> str | None:
    """The head of the migration chain, read from the files (importing Alembic costs ~100 ms)."""
    import re

    from vgpumgr.db.session import MIGRATIONS_DIR

    revs, downs = set(), set()
    for f in (MIGRATIONS_DIR / "versions").glob("*.py"):
        text = f.read_text()
        rev = re.search(r'^revision\s*=\s*["\']([^"\']+)', text, re.M)
        down = re.search(r'^down_revision\s*=\s*["\']([^"\']+)', text, re.M)
        if rev:
            revs.add(rev.group(1))
        if down:
            downs.add(down.group(1))
    heads = revs - downs
    return heads.pop() if len(heads) == 1 else None


def _stored_revision(url: str) -> str | None:
    from sqlalchemy import text

    from vgpumgr.db.session import get_engine

    try:
        with get_engine(url).connect() as conn:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except Exception:  # noqa: BLE001 - no table yet, or no database: let the upgrade create it
        return None


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
        checkpoints.attach(self.sessions, checkpoints.Checkpointer.from_env(cfg.state_dir, self.hostname,
                                                                            simulated=self.host.simulated))
        self.lock_path = cfg.state_dir / "vgpumgr.lock"
        self.snapshot_ttl = snapshot_ttl
        # A simulated host has no vendor driver that could remove an mdev by itself, so nothing to wait for.
        default_grace = 0.0 if self.host.simulated else NVIDIA_TEARDOWN_GRACE
        self.teardown_grace = float(os.environ.get("VGPUMGR_NVIDIA_TEARDOWN_GRACE", default_grace))
        self._snapshot: Snapshot | None = None
        self._dirty_gpus: set[str | None] = set()
        self._host_id: int | None = None
        self._gpu_ids: dict[str, int] = {}
        from vgpumgr.discovery.mdev import TypeCache

        self._type_cache = TypeCache(None)  # static type facts, kept in memory for the service's life
        with self.tx() as s:
            self._host_id = store.upsert_host(s, self.hostname).id
        self._snap_lock = threading.Lock()
        self._thread_lock = threading.RLock()

    # -- plumbing -------------------------------------------------------------------------------
    @contextmanager
    def tx(self) -> Iterator[Session]:
        with self.sessions.begin() as s:
            yield s

    @contextmanager
    def locked(self, timeout: float = 30.0) -> Iterator[None]:
        """Threads of this process queue on a lock of their own (no polling); the flock excludes other
        processes (the CLI next to the service, a second service)."""
        if not self._thread_lock.acquire(timeout=timeout):
            raise Busy("another request of this process holds the host lock", hint="retry in a moment")
        try:
            with host_lock(self.lock_path, timeout=timeout):
                yield
        finally:
            self._thread_lock.release()

    def _db_host(self, s: Session) -> int:
        """This host's row id (made when the service starts)."""
        if self._host_id is None:
            with self.tx() as hs:
                self._host_id = store.upsert_host(hs, self.hostname).id
        return self._host_id

    def event(self, s: Session, action: str, outcome: str = OK, *, actor: str | None = None, **kw: Any) -> None:
        audit.append(s, actor=actor or self.cfg.actor, action=action, outcome=outcome, host=self.hostname, **kw)

    def record_failure(self, action: str, error: BaseException, *, actor: str | None = None, **kw: Any) -> None:
        with self.tx() as s:
            self.event(s, action, FAILED, actor=actor, error=str(error), **kw)

    def snapshot(self, refresh: bool = False) -> Snapshot:
        """The host as last read. Our own changes re-read only the GPU they touched; anything else
        (udev events, other processes) is picked up by `invalidate()` or after `snapshot_ttl` seconds."""
        with self._snap_lock:
            snap = self._snapshot
            if refresh or snap is None or time.monotonic() - snap.taken > self.snapshot_ttl:
                inv = scan(self.host)
                self._merge_nvml(inv)
                snap = self._snapshot = Snapshot(inv, Placer(inv))
                self._dirty_gpus.clear()
            elif self._dirty_gpus:
                inv = self._rescan_gpus(snap.inventory, self._dirty_gpus)
                snap = self._snapshot = Snapshot(inv, Placer(inv), snap.taken)
                self._dirty_gpus.clear()
            return snap

    def _rescan_gpus(self, inv: Inventory, gpus: set[str | None]) -> Inventory:
        from vgpumgr.discovery import mdev as mdev_disc
        from vgpumgr.discovery import nvidia_vf as vf_disc
        from vgpumgr.inventory import discover_types

        parents = {t.parent for t in inv.types if t.gpu in gpus or (t.gpu is None and t.parent in gpus)}
        types = [t for t in inv.types if t.parent not in parents]
        for p in sorted(parents):
            types += discover_types(self.host, p, cache=self._type_cache)
        names = {int(t.type[7:]): t.name for t in types if t.type.startswith("nvidia-")}
        names |= {int(v.type[7:]): v.name for v in inv.vf_vgpus if v.name}
        # a new Inventory: placers of older snapshots may still be reading the old one in other threads
        return Inventory(gpus=inv.gpus, types=types, mdevs=mdev_disc.discover_mdevs(self.host),
                         vf_vgpus=vf_disc.discover_vf_vgpus(self.host, names))

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
            parent = a.pci_address if a.backend == BACKEND_NVIDIA_VF else a.parent
            out.append(PlacedAlloc(gpu=d.get("gpu"), parent=parent,
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
                 detail: dict[str, Any] | None = None, free_gpu_instances: dict[str, list[str]] | None = None
                 ) -> dict[str, Any]:
        """Place and create one vGPU. A retried request with the same idempotency key gets the same vGPU."""
        uuid = ids.mdev_uuid(uuid) if uuid else None
        vm = ids.vm_name(vm) if vm else None
        policy = policy or Policy()
        with self.locked():
            if idempotency_key:
                found = self._by_key(idempotency_key)
                if found is not None:
                    return found
            with self.tx() as s:  # one transaction: read the records, place, reserve, take a seat, audit
                decision = self._decide(s, type_name, vm, policy, free_gpu_instances)
                c = decision.choice
                if c is None:
                    err = NoCapacity(f"no GPU can take a {type_name} vGPU now: {decision.summary()}",
                                     hint="`vgpumgr place --type ... --explain` shows why each candidate was refused",
                                     rejected=[r.__dict__ for r in decision.rejected][:20])
                    self.event(s, audit.PLACEMENT, FAILED, actor=actor, vm=vm, error=str(err),
                               detail={"type": type_name, "policy": dataclasses.asdict(policy)})
                else:
                    inv = self.snapshot().inventory
                    t = next((t for t in inv.types_of(c.parent) if t.type == c.type), None)
                    parsed = ids.parse_type_name(c.name or "")
                    fb = t.framebuffer_mb if t and t.framebuffer_mb else (
                        int(parsed.framebuffer_gb * 1024) if parsed else None)
                    series = t.series if t and t.series else (parsed.series if parsed else None)
                    new_uuid = (uuid or ids.new_uuid()) if c.backend == BACKEND_MDEV else None
                    g = inv.gpu(c.gpu) if c.gpu else None
                    h = self._db_host(s)
                    gpu_row = self._gpu_row(s, c.gpu, g.name if g else "") if c.gpu else None
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
            if c is None:
                raise err
            try:
                if c.backend == BACKEND_MDEV:
                    mdev_backend.create(self.host, c.parent, c.type, new_uuid)
                else:
                    nvidia_vf.set_type(self.host, c.parent, c.type)
            except BaseException as e:
                self._rollback_allocation(row_id, e, actor)
                self.invalidate()
                raise
            self._touch(c.gpu, c.parent)
            with self.tx() as s:
                row = s.get(AllocRow, row_id)
                store.activate(s, row)
                self.event(s, audit.VGPU_CREATE, actor=actor, gpu=c.gpu, vm=vm, vgpu=row.uuid or row.pci_address,
                           detail={"type": c.type, "name": c.name, "parent": c.parent, "backend": c.backend})
                return allocation_dict(row, s)

    def _decide(self, s: Session, type_name: str, vm: str | None, policy: Policy,
                free_gpu_instances: dict[str, list[str]] | None = None) -> Decision:
        records = self._live_records(s)
        req = Request(type_name, vm)
        decision = self.snapshot().placer.place(records, req, policy, free_gpu_instances=free_gpu_instances)
        if decision.choice is None and time.monotonic() - self.snapshot().taken > 0.05:
            decision = self.snapshot(refresh=True).placer.place(records, req, policy,
                                                                free_gpu_instances=free_gpu_instances)
        return decision

    def _gpu_row(self, s: Session, address: str, model: str) -> Any:
        """The GPU's row (upserted once per service; later a primary-key lookup, or just its id when licences
        are off)."""
        key = self._gpu_ids.get(address)
        if key is not None and self.licence_mode == licensing.MODE_OFF:
            return key
        row = s.get(GpuRow, key) if key is not None else None
        if row is None:
            row = store.upsert_gpu(s, self._db_host(s), address, model=model)
            self._gpu_ids[address] = row.id
        return row

    def _touch(self, gpu: str | None, parent: str) -> None:
        """Our own change: re-read that GPU's parents (availability moves across all VFs of a GPU)."""
        with self._snap_lock:
            self._dirty_gpus.add(gpu or parent)

    def _by_key(self, key: str) -> dict[str, Any] | None:
        with self.sessions() as s:
            row = store.find_by_idempotency_key(s, self._db_host(s), key)
            if row is None:
                return None
            if row.state == "released":
                raise Conflict(f"idempotency key '{key}' belongs to a released vGPU",
                               hint="use a new key for a new request")
            return allocation_dict(row, s)

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
                return allocation_dict(row, s)

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

    def release(self, ref: str, *, actor: str | None = None, grace: float = 0.0,
                check_libvirt: bool = True) -> dict[str, Any]:
        """Destroy the device of a live allocation and release its record and licence seat."""
        with self.locked():
            with self.sessions() as s:
                row = self._live_row(s, ref)
                row_id, backend = row.id, row.backend
                uuid, address = row.uuid, row.pci_address
                vm_name = allocation_dict(row, s)["vm"]
                gpu, parent = (row.detail or {}).get("gpu"), row.parent
            # A running QEMU holds the device's VFIO group, which the backends see in /proc; libvirt is
            # asked as well only for a vGPU that belongs to a VM (its domain may run under another driver).
            # (check_libvirt=False from inside a libvirt hook: calling libvirtd back from there can deadlock)
            use_libvirt = bool(vm_name and check_libvirt)
            try:
                if backend == BACKEND_MDEV and uuid:
                    mdev_backend.remove(self.host, uuid, grace=grace,
                                        holder_check=self._libvirt_holders("mdev") if use_libvirt else None)
                elif backend == BACKEND_NVIDIA_VF and address:
                    nvidia_vf.clear_type(self.host, address,
                                         holder_check=self._libvirt_holders("pci") if use_libvirt else None,
                                         retries=10 if grace else 3, delay=1.0 if grace else 0.2)
            except VgpuError as e:
                self.record_failure(audit.VGPU_REMOVE, e, actor=actor, vm=vm_name, vgpu=uuid or address)
                raise
            self._touch(gpu, parent)
            with self.tx() as s:
                row = s.get(AllocRow, row_id)
                store.release(s, row)
                self.event(s, audit.VGPU_REMOVE, actor=actor, gpu=(row.detail or {}).get("gpu"), vm=vm_name,
                           vgpu=uuid or address, detail={"type": row.type_id, "backend": backend})
                return allocation_dict(row, s)

    def _libvirt_holders(self, kind: str):  # noqa: ANN202
        from vgpumgr.virt import holder_check

        return holder_check(self.cfg.libvirt_uri, self.cfg.state_dir, kind)

    def allocations(self, *, vm: str | None = None, gpu: str | None = None, state: str | None = None,
                    live: bool | None = None) -> list[dict[str, Any]]:
        with self.sessions() as s:
            return [allocation_dict(a, s) for a in store.allocations(s, self._db_host(s), vm=vm, gpu=gpu, state=state,
                                                                   live=live)]

    # -- VMs ------------------------------------------------------------------------------------
    def virt(self):  # noqa: ANN201
        from vgpumgr.virt import Virt

        return Virt(self.cfg.libvirt_uri, state_dir=self.cfg.state_dir)

    def create_vm(self, name: str, *, vgpus: list[str] | None = None, passthrough: list[str] | None = None,
                  mig: list[str] | None = None, memory_mib: int = 4096, vcpus: int = 2, disk: str | None = None,
                  network: str | None = None, firmware: str = "bios", display: bool = False,
                  policy: Policy | None = None, start: bool = False, print_xml: bool = False,
                  idempotency_key: str | None = None, actor: str | None = None) -> dict[str, Any]:
        """Place and create the VM's GPU devices, render and validate its XML, define (and start) it.

        Any failure undoes what was done, in reverse order, and is audited. `print_xml` changes nothing."""
        from vgpumgr.domain import VmSpec, render

        name = ids.vm_name(name)
        vgpus, passthrough, mig = list(vgpus or []), [ids.pci_address(a) for a in passthrough or []], list(mig or [])
        if not (vgpus or passthrough or mig):
            raise InvalidInput("a VM needs at least one GPU device",
                               hint="give --vgpu TYPE, --passthrough BDF or --mig PROFILE")
        vm_uuid = ids.new_uuid()
        spec = VmSpec(name=name, uuid=vm_uuid, memory_mib=memory_mib, vcpus=vcpus, firmware=firmware, disk=disk,
                      network=network, domain_type=self.cfg.domain_type)
        render(spec)  # bad memory, disk path or network is refused before anything is allocated
        if print_xml:
            spec.hostdevs = self._dry_run_hostdevs(name, vgpus, passthrough, mig, policy, display)
            return {"name": name, "uuid": vm_uuid, "state": "not defined", "xml": render(spec), "allocations": []}
        virt = self.virt()
        if virt.exists(name):
            raise Conflict(f"a VM named {name} already exists", hint="choose another name or delete it first")
        made: list[dict[str, Any]] = []
        defined = started = False
        try:
            key = idempotency_key
            for i, t in enumerate(vgpus):
                made.append(self.allocate(t, vm=name, policy=policy, actor=actor,
                                          idempotency_key=f"{key}/vgpu/{i}" if key else None))
            for i, profile in enumerate(mig):
                made.append(self.allocate_mig(profile, vm=name, policy=policy, actor=actor,
                                              idempotency_key=f"{key}/mig/{i}" if key else None))
            for i, addr in enumerate(passthrough):
                made.append(self.allocate_passthrough(addr, vm=name, actor=actor,
                                                      idempotency_key=f"{key}/pt/{i}" if key else None))
            spec.hostdevs = [hostdev_for(a, display and i == 0) for i, a in enumerate(made)]
            spec.allocations = [metadata_for(a) for a in made]
            xml = render(spec)
            virt.define(xml)
            defined = True
            if start:
                virt.start(name)
                started = True
            with self.tx() as s:
                store.upsert_vm(s, self._db_host(s), name, uuid=vm_uuid, state="running" if started else "defined")
                self.event(s, audit.VM_DEFINE, actor=actor, vm=name,
                           detail={"uuid": vm_uuid, "devices": [a.get("uuid") or a.get("pci_address") for a in made]})
                if started:
                    self.event(s, audit.VM_START, actor=actor, vm=name)
        except BaseException as e:
            self._undo_vm(virt, name, made, defined, started, e, actor)
            raise
        return {"name": name, "uuid": vm_uuid, "state": "running" if started else "defined", "allocations": made}

    def _undo_vm(self, virt, name: str, made: list[dict[str, Any]], defined: bool, started: bool,  # noqa: ANN001
                 error: BaseException, actor: str | None) -> None:
        undone = []
        if started:
            with _suppress():
                virt.stop(name)
                undone.append("stopped")
        if defined:
            with _suppress():
                virt.undefine(name)
                undone.append("undefined")
        for a in reversed(made):
            with _suppress():
                self.release(a.get("uuid") or a["pci_address"], actor=actor)
                undone.append(f"released {a.get('uuid') or a.get('pci_address')}")
        with self.tx() as s:
            h = self._db_host(s)
            vm_row = store.get_vm(s, h, name)
            if vm_row is not None and not store.allocations(s, h, vm=vm_row, live=True):
                vm_row.state = "deleted"
            self.event(s, "vm.create", FAILED, actor=actor, vm=name, error=str(error), detail={"rolled_back": undone})

    def _dry_run_hostdevs(self, name: str, vgpus: list[str], passthrough: list[str], mig: list[str],
                          policy: Policy | None, display: bool) -> list[Any]:
        from vgpumgr.dryrun import plan_hostdevs

        snap = self.snapshot()
        with self.sessions() as s:
            records = self._live_records(s)
        return plan_hostdevs(snap.inventory, snap.placer, records, name, vgpus, passthrough, mig, policy, display)

    def delete_vm(self, name: str, *, actor: str | None = None) -> dict[str, Any]:
        """Stop and undefine the VM, then release its vGPUs and licence seats."""
        name = ids.vm_name(name)
        virt = self.virt()
        exists = virt.exists(name)
        was_running = exists and virt.state(name) in ("running", "paused")
        if was_running:
            virt.stop(name)
        if exists:
            virt.undefine(name)
        released = []
        for a in self.allocations(vm=name, live=True):
            ref = a["uuid"] or a["pci_address"]
            self.release(ref, actor=actor, grace=self.teardown_grace if was_running and _is_nvidia(a) else 0.0)
            released.append(ref)
        with self.tx() as s:
            h = self._db_host(s)
            vm_row = store.get_vm(s, h, name)
            if vm_row is None and not exists:
                raise NotFound(f"no VM {name}", hint="`vgpumgr vm list` shows the VMs")
            if vm_row is not None:
                vm_row.state = "deleted"
            if was_running:
                self.event(s, audit.VM_STOP, actor=actor, vm=name)
            self.event(s, audit.VM_UNDEFINE, actor=actor, vm=name, detail={"released": released})
        return {"name": name, "state": "deleted", "released": released}

    def start_vm(self, name: str, *, actor: str | None = None) -> dict[str, Any]:
        name = ids.vm_name(name)
        self._ensure_devices(name, actor)
        return self._power(name, audit.VM_START, "running", lambda v: v.start(name), actor)

    def stop_vm(self, name: str, *, actor: str | None = None, force: bool = True) -> dict[str, Any]:
        name = ids.vm_name(name)
        return self._power(name, audit.VM_STOP, "shut off", lambda v: v.stop(name, force=force), actor)

    def _power(self, name: str, action: str, state: str, op: Any, actor: str | None) -> dict[str, Any]:
        try:
            op(self.virt())
        except VgpuError as e:
            self.record_failure(action, e, actor=actor, vm=name)
            raise
        with self.tx() as s:
            store.upsert_vm(s, self._db_host(s), name, state=state)
            self.event(s, action, actor=actor, vm=name)
        return self.vm(name)

    def _ensure_devices(self, name: str, actor: str | None) -> list[str]:
        """Re-create a VM's recorded vGPUs that vanished (after a reboot or driver reload) before a start."""
        restored = []
        for a in self.allocations(vm=name, live=True):
            if a["backend"] == BACKEND_MDEV and mdev_backend.get(self.host, a["uuid"]) is None:
                mdev_backend.create(self.host, a["parent"], a["type"], a["uuid"])
                restored.append(a["uuid"])
            elif a["backend"] == BACKEND_NVIDIA_VF and nvidia_vf.current(self.host, a["pci_address"]) == 0:
                nvidia_vf.set_type(self.host, a["pci_address"], a["type"])
                restored.append(a["pci_address"])
        if restored:
            self.invalidate()
            with self.tx() as s:
                self.event(s, audit.RECONCILE, actor=actor, vm=name, detail={"restored": restored})
        return restored

    def list_vms(self) -> list[dict[str, Any]]:
        virt = self.virt()
        live = {a["vm"]: [] for a in self.allocations(live=True) if a["vm"]}
        for a in self.allocations(live=True):
            if a["vm"]:
                live[a["vm"]].append(a.get("uuid") or a.get("pci_address"))
        out = []
        for d in virt.list():
            out.append({**d, "vgpus": live.get(d["name"], [])})
        return sorted(out, key=lambda d: d["name"])

    def vm(self, name: str) -> dict[str, Any]:
        from vgpumgr.domain import read_allocations

        name = ids.vm_name(name)
        virt = self.virt()
        if not virt.exists(name):
            raise NotFound(f"no VM {name}", hint="`vgpumgr vm list` shows the VMs")
        d = next(x for x in virt.list() if x["name"] == name)
        return {**d, "allocations": self.allocations(vm=name, live=True),
                "metadata": read_allocations(virt.xml(name))}

    def vm_xml(self, name: str) -> str:
        name = ids.vm_name(name)
        virt = self.virt()
        if not virt.exists(name):
            raise NotFound(f"no VM {name}", hint="`vgpumgr vm list` shows the VMs")
        return virt.xml(name)

    def attach_vgpu(self, name: str, type_name: str, *, actor: str | None = None) -> dict[str, Any]:
        from vgpumgr.domain import hostdev_xml

        name = ids.vm_name(name)
        virt = self.virt()
        if not virt.exists(name):
            raise NotFound(f"no VM {name}", hint="`vgpumgr vm list` shows the VMs")
        a = self.allocate(type_name, vm=name, actor=actor)
        try:
            virt.attach(name, hostdev_xml(hostdev_for(a, False)))
        except BaseException:
            self.release(a.get("uuid") or a["pci_address"], actor=actor)
            raise
        return a

    def detach_vgpu(self, name: str, ref: str, *, actor: str | None = None) -> dict[str, Any]:
        from vgpumgr.domain import hostdev_xml

        name = ids.vm_name(name)
        a = self.find_allocation(ref)
        if a["vm"] != name:
            raise Conflict(f"{ref} does not belong to VM {name}", hint="`vgpumgr vm show NAME` lists its vGPUs")
        self.virt().detach(name, hostdev_xml(hostdev_for(a, False)))
        return self.release(ref, actor=actor)

    # -- MIG-backed vGPU ------------------------------------------------------------------------
    def _mig_type_name(self, profile: str, gpu: str | None) -> str:
        from vgpumgr.dryrun import mig_type_name

        return mig_type_name(self.snapshot().inventory, profile, gpu)[0]

    def allocate_mig(self, profile: str, *, vm: str | None = None, policy: Policy | None = None,
                     idempotency_key: str | None = None, actor: str | None = None) -> dict[str, Any]:
        """A MIG-backed vGPU: reuse or create a matching GPU instance, then place the matching type on a VF."""
        from vgpumgr import mig as mig_plan

        profile = mig_plan.normalise_profile_name(profile)
        layer = self._nvml()
        with self.locked():
            if idempotency_key:
                found = self._by_key(idempotency_key)
                if found is not None:
                    return found
            created = None
            free = self._free_gpu_instances(layer)
            if not any(profile in v for v in free.values()):
                gpu = self._gpu_for_new_instance(layer, profile, policy)
                created = layer.create_gpu_instance(gpu, profile)
                self._sync_sim_mig(layer)
                self.invalidate()
                with self.tx() as s:
                    self.event(s, "mig.gi.create", actor=actor, gpu=gpu, vm=vm, detail=created)
                free = self._free_gpu_instances(layer)
            gpu = next(a for a in sorted(free) if profile in free[a])
            type_name = self._mig_type_name(profile, gpu)
            pinned = dataclasses.replace(policy or Policy(), pin_gpu=gpu)
            try:
                return self.allocate(type_name, vm=vm, policy=pinned, idempotency_key=idempotency_key, actor=actor,
                                     detail={"mig_profile": profile}, free_gpu_instances=free)
            except BaseException:
                if created:
                    with _suppress():
                        layer.destroy_gpu_instance(created["address"], created["gpu_instance"]["id"])
                        self._sync_sim_mig(layer)
                        self.invalidate()
                raise

    def _nvml(self):  # noqa: ANN202
        from vgpumgr.nvml_facts import nvml_layer

        layer = nvml_layer(self.cfg)
        if layer is None or not layer.open():
            raise VgpuError("NVML is not available, so MIG instances cannot be managed",
                            hint="install the NVIDIA driver's NVML (libnvidia-ml) and nvidia-ml-py")
        return layer

    def _free_gpu_instances(self, layer) -> dict[str, list[str]]:  # noqa: ANN001
        """GPU instances not yet bound to a vGPU, by GPU address (profile names)."""
        with self.sessions() as s:
            used: dict[str, list[str]] = {}
            for a in store.allocations(s, self._db_host(s), live=True):
                p = (a.detail or {}).get("mig_profile")
                if p:
                    used.setdefault((a.detail or {}).get("gpu"), []).append(p)
        out: dict[str, list[str]] = {}
        for addr, g in layer.gpus().items():
            if (g.get("mig") or {}).get("current") != "enabled":
                continue
            names = [gi["profile"] for gi in g["mig"]["gpu_instances"]]
            for p in used.get(addr, []):
                if p in names:
                    names.remove(p)
            out[addr] = names
        return out

    def _gpu_for_new_instance(self, layer, profile: str, policy: Policy | None) -> str:  # noqa: ANN001
        from vgpumgr import mig as mig_plan

        reasons = []
        for addr in sorted(layer.gpus()):
            g = layer.gpus()[addr]
            if (g.get("mig") or {}).get("current") != "enabled":
                reasons.append(f"{addr}: MIG is off")
                continue
            if policy and policy.pin_gpu and policy.pin_gpu != addr:
                continue
            try:
                table = layer.mig_table(addr)
                mig_plan.plan(table, layer.gpu_instances(addr), table.find(profile))
                return addr
            except VgpuError as e:
                reasons.append(f"{addr}: {e.message}")
        raise NoCapacity(f"no GPU has room for a {profile} GPU instance", hint="; ".join(reasons) or "no MIG GPU")

    def _sync_sim_mig(self, layer) -> None:  # noqa: ANN001
        """On a simulated host, tell the sysfs emulator which GPU instances exist (the driver knows it itself)."""
        if not self.host.simulated:
            return
        from vgpumgr.sim.mig_link import sync_from_nvml

        sync_from_nvml(self.host.root, layer)

    # -- reconcile ------------------------------------------------------------------------------
    def reconcile(self, *, fix: bool = False, remove_unknown: bool = False, actor: str | None = None
                  ) -> dict[str, Any]:
        """Compare records with sysfs: recorded vGPUs that vanished, and devices nobody recorded."""
        with self.locked():
            inv = self.snapshot(refresh=True).inventory
            live = self.allocations(live=True)
            mdevs = {m.uuid: m for m in inv.mdevs}
            vfs = {v.address: v for v in inv.vf_vgpus}
            missing, unknown, restored, removed, errors = [], [], [], [], []
            for a in live:
                if a["backend"] == BACKEND_MDEV and a["uuid"] not in mdevs:
                    missing.append(a)
                elif a["backend"] == BACKEND_NVIDIA_VF and a["pci_address"] not in vfs:
                    missing.append(a)
            recorded = {a["uuid"] for a in live if a["uuid"]} | {a["pci_address"] for a in live if a["pci_address"]}
            unknown = [m.to_json() for m in inv.mdevs if m.uuid not in recorded]
            unknown += [v.to_json() for v in inv.vf_vgpus if v.address not in recorded]
            if fix:
                for a in missing:
                    try:
                        if a["backend"] == BACKEND_MDEV:
                            mdev_backend.create(self.host, a["parent"], a["type"], a["uuid"])
                            restored.append(a["uuid"])
                        else:
                            nvidia_vf.set_type(self.host, a["pci_address"], a["type"])
                            restored.append(a["pci_address"])
                    except VgpuError as e:
                        errors.append(f"{a.get('uuid') or a.get('pci_address')}: {e}")
                if remove_unknown:
                    for u in unknown:
                        ref = u.get("uuid") or u.get("address")
                        try:
                            if "uuid" in u:
                                mdev_backend.remove(self.host, u["uuid"])
                            else:
                                nvidia_vf.clear_type(self.host, u["address"], retries=1)
                            removed.append(ref)
                        except VgpuError as e:
                            errors.append(f"{ref}: {e}")
                self.invalidate()
            report = {"missing": [a.get("uuid") or a.get("pci_address") for a in missing],
                      "missing_detail": missing, "unknown": unknown, "restored": restored, "removed": removed,
                      "errors": errors, "fixed": fix}
            with self.tx() as s:
                self.event(s, audit.RECONCILE, FAILED if errors else (WARNING if (missing or unknown) and not fix
                                                                       else OK), actor=actor,
                           detail={k: v for k, v in report.items() if k != "missing_detail"})
            return report


def allocation_dict(a: AllocRow, s: Session | None = None) -> dict[str, Any]:
    detail = a.detail or {}
    vm = None
    session = s or object_session(a)
    if a.vm_id is not None:
        row = session.get(Vm, a.vm_id) if session else None
        vm = row.name if row else None
    return {
        "id": a.id, "uuid": a.uuid, "pci_address": a.pci_address, "backend": a.backend, "parent": a.parent,
        "gpu": detail.get("gpu"), "type": a.type_id,
        "type_name": a.type_name, "series": a.series, "vm": vm,
        "state": a.state, "idempotency_key": a.idempotency_key,
        "licence": _edition(session, a.lease_id) if session is not None and a.lease_id else None,
        "created_at": _iso(a.created_at), "activated_at": _iso(a.activated_at), "released_at": _iso(a.released_at),
    }


def hostdev_for(a: dict[str, Any], display: bool):  # noqa: ANN201
    from vgpumgr.domain import Hostdev

    if a["backend"] == BACKEND_MDEV:
        return Hostdev("mdev", uuid=a["uuid"], display=display)
    if a["backend"] == BACKEND_NVIDIA_VF:
        return Hostdev("nvidia-vf", address=a["pci_address"])
    return Hostdev("passthrough", address=a["pci_address"])


def metadata_for(a: dict[str, Any]) -> dict[str, Any]:
    """What the domain's <metadata> carries so the state can be rebuilt from libvirt alone."""
    keys = ("uuid", "pci_address", "backend", "parent", "gpu", "type", "type_name", "series", "idempotency_key")
    return {k: a[k] for k in keys if a.get(k) is not None}


def _is_nvidia(a: dict[str, Any]) -> bool:
    return str(a.get("type", "")).startswith("nvidia-")


@contextmanager
def _suppress() -> Iterator[None]:
    """Best-effort undo: one failing step must not stop the others."""
    try:
        yield
    except Exception:  # noqa: BLE001
        pass


def _edition(s: Session, lease_id: int) -> str | None:
    lease = s.get(LicenceLease, lease_id)
    return lease.pool.edition if lease is not None else None


def _iso(v: Any) -> str | None:
    return v.isoformat() if v is not None else None


def record_event(cfg: Config, action: str, *, outcome: str = OK, gpu: str | None = None, vm: str | None = None,
                 vgpu: str | None = None, error: str | None = None, detail: dict[str, Any] | None = None) -> None:
    """Audit a change made outside the allocation flow (manual mdev/VF/SR-IOV/vfio commands)."""
    ensure_schema(cfg.db_url)
    factory = session_factory(cfg.db_url)
    checkpoints.attach(factory, checkpoints.Checkpointer.from_env(cfg.state_dir, hostname(), cfg.host.simulated))
    with factory.begin() as s:
        audit.append(s, actor=cfg.actor, action=action, outcome=outcome, host=hostname(), gpu=gpu, vm=vm,
                     vgpu=vgpu, error=error, detail=detail)
