"""The unit of work every use case shares: the host lock, a database transaction, audit events, and the
host as last read.

A change is always `with ctx.locked():` around reading the records, choosing and writing to the kernel,
and `with ctx.tx() as s:` around each group of rows that must commit together with its `ctx.event(s, ...)`.
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

from sqlalchemy.orm import Session

from vgpumgr.audit import chain as audit
from vgpumgr.audit import checkpoints
from vgpumgr.config import Config
from vgpumgr.db import store
from vgpumgr.db.session import ensure_schema, read_sessions, session_factory
from vgpumgr.discovery.inventory import scan
from vgpumgr.errors import Busy, SchemaMismatch, VgpuError
from vgpumgr.hostfs.locking import host_lock
from vgpumgr.licensing import seats as licensing
from vgpumgr.model import Inventory
from vgpumgr.placement.placer import Placer

OK, FAILED, WARNING = "ok", "failed", "warning"
NVIDIA_TEARDOWN_GRACE = 10.0  # seconds NVIDIA's driver may take to remove an mdev itself after QEMU exits


def hostname() -> str:
    return os.environ.get("VGPUMGR_HOSTNAME") or socket.gethostname()


def record_event(cfg: Config, action: str, *, outcome: str = OK, gpu: str | None = None, vm: str | None = None,
                 vgpu: str | None = None, error: str | None = None, detail: dict[str, Any] | None = None,
                 actor: str | None = None) -> None:
    """Audit a change made outside the allocation flow (manual mdev/VF/SR-IOV/vfio commands)."""
    ensure_schema(cfg.db_url)
    factory = session_factory(cfg.db_url)
    checkpoints.attach(factory, checkpoints.Checkpointer.from_env(cfg.state_dir, hostname(), cfg.host.simulated))
    with factory.begin() as s:
        audit.append(s, actor=actor or cfg.actor, action=action, outcome=outcome, host=hostname(), gpu=gpu, vm=vm,
                     vgpu=vgpu, error=error, detail=detail)


@dataclass(frozen=True)
class GpuRef:
    """A GPU row as far as an allocation and licensing.acquire read it."""

    id: int
    address: str


@dataclass
class Snapshot:
    inventory: Inventory
    placer: Placer
    taken: float = field(default_factory=time.monotonic)


class Context:
    def __init__(self, cfg: Config, licence_mode: str | None = None, snapshot_ttl: float = 5.0) -> None:
        self.cfg = cfg
        self.host = cfg.host
        self.hostname = hostname()
        self.licence_mode = licensing.check_mode(licence_mode or os.environ.get("VGPUMGR_LICENCE_MODE", "warn"))
        ensure_schema(cfg.db_url)
        self.sessions = session_factory(cfg.db_url)
        self.reads = read_sessions(cfg.db_url)  # lookups: no write lock taken (SQLite), never written through
        self.checkpointer = checkpoints.attach(self.sessions, checkpoints.Checkpointer.from_env(
            cfg.state_dir, self.hostname, simulated=self.host.simulated))
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
        from vgpumgr.fleet.publish import Publisher

        self.fleet = Publisher(self)  # this host's capacity for the fleet, published with each change
        with self.tx() as s:
            self._host_id = store.upsert_host(s, self.hostname).id
        self._snap_lock = threading.Lock()
        self._thread_lock = threading.RLock()
        self.schema_problem: VgpuError | None = None  # set by check_schema: the service then answers 503

    def check_schema(self) -> VgpuError | None:
        """Read the database's schema state again (the service, on each heartbeat): a contract step run since this
        process started means this code may no longer use it (vgpumgr.db.schema)."""
        from vgpumgr.db import schema
        from vgpumgr.db.session import get_engine, stored_state

        try:
            state = stored_state(self.cfg.db_url)
            if state is not None:
                schema.check(state, dialect=get_engine(self.cfg.db_url).dialect.name)
            self.schema_problem = None
        except SchemaMismatch as exc:
            self.schema_problem = exc
        return self.schema_problem

    # -- the unit of work -----------------------------------------------------------------------
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

    def event(self, s: Session, action: str, outcome: str = OK, *, actor: str | None = None, **kw: Any) -> None:
        audit.record(s, actor=actor or self.cfg.actor, action=action, outcome=outcome, host=self.hostname, **kw)
        if self.fleet.wanted:  # every change audits itself: its capacity goes out in the same transaction
            self.fleet.publish(s)

    def record_failure(self, action: str, error: BaseException, *, actor: str | None = None, **kw: Any) -> None:
        with self.tx() as s:
            self.event(s, action, FAILED, actor=actor, error=str(error), **kw)

    def verify_audit(self) -> audit.VerifyResult:
        """The hash chain walked and compared with every signed checkpoint outside the database."""
        with self.sessions() as s:
            return self.checkpointer.verify(s)

    # -- rows this process keeps the ids of -----------------------------------------------------
    def host_id(self, s: Session) -> int:
        """This host's row id (made when the service starts)."""
        if self._host_id is None:
            with self.tx() as hs:
                self._host_id = store.upsert_host(hs, self.hostname).id
        return self._host_id

    def gpu_row(self, s: Session, address: str, model: str) -> Any:
        """The GPU's row, upserted once per service; later only what the allocation and its licence seat read
        of it (id and address), without a query."""
        key = self._gpu_ids.get(address)
        if key is not None:
            return GpuRef(key, address)
        row = store.upsert_gpu(s, self.host_id(s), address, model=model)
        self._gpu_ids[address] = row.id
        return row

    # -- the host as last read ------------------------------------------------------------------
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
        from vgpumgr.discovery.inventory import discover_types

        touched = {g for g in gpus if g}
        # The touched GPUs' vendor VFs are parents too, whether or not they listed types: one with a vGPU set
        # lists none, and lists them again once it is cleared.
        vendor_vfs = vf_disc.vendor_vfs(self.host, touched)
        parents = {t.parent for t in inv.types if t.gpu in gpus or (t.gpu is None and t.parent in gpus)}
        parents.update(vendor_vfs)
        types = [t for t in inv.types if t.parent not in parents]
        for p in sorted(parents):
            types += discover_types(self.host, p, cache=self._type_cache)
        # Only the touched GPUs' devices are re-read; the rest of the host is as the snapshot saw it.
        scope = touched | parents
        mdevs = [m for m in inv.mdevs if m.parent not in scope] + mdev_disc.discover_mdevs(self.host, scope)
        found = vf_disc.discover_vf_vgpus(self.host, None, scope, vfs=vendor_vfs)
        if found:  # their type names (a set type leaves the VF's creatable list): gathered only when needed
            names = {int(t.type[7:]): t.name for t in types if t.type.startswith("nvidia-")}
            names |= {int(v.type[7:]): v.name for v in inv.vf_vgpus if v.name}
            for v in found:  # new objects, not yet seen by any other snapshot
                v.name = names.get(int(v.type[7:]))
        vfs = [v for v in inv.vf_vgpus if v.gpu not in scope] + found
        # a new Inventory: placers of older snapshots may still be reading the old one in other threads
        return Inventory(gpus=inv.gpus, types=types, mdevs=sorted(mdevs, key=lambda m: m.uuid),
                         vf_vgpus=sorted(vfs, key=lambda v: v.address))

    def invalidate(self) -> None:
        with self._snap_lock:
            self._snapshot = None
        self.fleet.mark_all()

    def known_parent(self, parent: str) -> tuple[str | None, str] | None:
        """(GPU, parent) of an mdev parent the current snapshot knows (a GPU, one of its VFs, a virtual parent
        such as mtty), for `touch`; None when there is no snapshot or the parent is not in it."""
        with self._snap_lock:
            snap = self._snapshot
        if snap is None:
            return None
        g = snap.placer.gpus.get(parent)
        if g is not None:  # a GPU or one of its VFs: the physical GPU is re-read
            return g.physical, parent
        for x in (*snap.inventory.types, *snap.inventory.mdevs):
            if x.parent == parent:
                return x.gpu, parent
        return None

    def touch(self, gpu: str | None, parent: str) -> None:
        """Our own change: re-read that GPU's parents (availability moves across all VFs of a GPU)."""
        with self._snap_lock:
            self._dirty_gpus.add(gpu or parent)
        self.fleet.mark(gpu)

    def _merge_nvml(self, inv: Inventory) -> None:
        try:
            from vgpumgr.nvidia.facts import merge_nvml
        except ImportError:
            return
        merge_nvml(self.cfg, inv.gpus, quiet=True)

    # -- the outside systems --------------------------------------------------------------------
    def virt(self):  # noqa: ANN201
        from vgpumgr.virt.driver import Virt

        return Virt(self.cfg.libvirt_uri, state_dir=self.cfg.state_dir)

    def libvirt_holders(self, kind: str):  # noqa: ANN201
        from vgpumgr.virt.holders import holder_check

        return holder_check(self.cfg.libvirt_uri, self.cfg.state_dir, kind)

    def nvml(self):  # noqa: ANN201
        from vgpumgr.nvidia.facts import nvml_layer

        layer = nvml_layer(self.cfg)
        if layer is None or not layer.open():
            raise VgpuError("NVML is not available, so MIG instances cannot be managed",
                            hint="install the NVIDIA driver's NVML (libnvidia-ml) and nvidia-ml-py")
        return layer


@contextmanager
def suppress() -> Iterator[None]:
    """Best-effort undo: one failing step must not stop the others."""
    try:
        yield
    except Exception:  # noqa: BLE001
        pass
