"""Publishing this host's capacity: after each change it makes, inside that change's own transaction, and on a
heartbeat (`vgpumgr serve`).

A change marks the GPU it touched (`Context.touch`) or the whole host (`Context.invalidate`); the next audit
event of a transaction (`Context.event`, which every change writes) publishes what was marked, from the host
snapshot re-read after the change. The capacity is computed before anything is written, so a failure to compute
it never touches the change's transaction: the heartbeat publishes again. The rows are a cache with a time stamp;
sysfs and the host's records stay the truth, and the host's own placement the final word.

Each change publishes when the database is PostgreSQL, the one a fleet can share; a SQLite database serves one
host, which its heartbeat publishes (for its own fleet page) without adding to every change.

Settings (environment): VGPUMGR_FLEET_PUBLISH=0 turns publishing off, =1 publishes every change on SQLite too;
VGPUMGR_FLEET_HEARTBEAT (seconds, default
30) and VGPUMGR_FLEET_STALE_FACTOR (default 3): a host whose heartbeat is older than heartbeat x factor is stale;
VGPUMGR_FLEET_ENDPOINT: where this host's REST service answers (default: what `serve` binds);
VGPUMGR_MIGRATION_URI: libvirt's URI for a migration into this host (default qemu+ssh://HOSTNAME/system).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from vgpumgr.config import env_seconds
from vgpumgr.db import store as db_store
from vgpumgr.db.schema import code_version
from vgpumgr.errors import InvalidInput
from vgpumgr.fleet import writes
from vgpumgr.fleet.capacity import GpuCapacity, host_capacity
from vgpumgr.fleet.follow import Follower
from vgpumgr.ops.records import placed

log = logging.getLogger("vgpumgr.fleet")
DEFAULT_HEARTBEAT_S = 30.0
DEFAULT_STALE_FACTOR = 3.0
FULL_EVERY = 10  # heartbeats: every tenth writes every GPU, changed or not
_UNREAD = object()


def stale_factor() -> float:
    raw = os.environ.get("VGPUMGR_FLEET_STALE_FACTOR")
    if not raw:
        return DEFAULT_STALE_FACTOR
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value >= 1.0:
        raise InvalidInput(f"VGPUMGR_FLEET_STALE_FACTOR={raw!r} is not a number of heartbeats of at least 1",
                           hint=f"unset it (default {DEFAULT_STALE_FACTOR:g}) or give e.g. 3")
    return value


class Publisher:
    """What this process has marked for publishing, and what it last wrote."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx  # the Context (host snapshot, host id, config): duck-typed, see vgpumgr.ops.context
        setting = os.environ.get("VGPUMGR_FLEET_PUBLISH", "")
        self.enabled = setting != "0"
        self.per_change = setting == "1" or (not setting and ctx.cfg.db_url.startswith("postgresql"))
        self.heartbeat_s = env_seconds("VGPUMGR_FLEET_HEARTBEAT", DEFAULT_HEARTBEAT_S, "30")
        self.stale_after_s = self.heartbeat_s * stale_factor()
        self.endpoint = os.environ.get("VGPUMGR_FLEET_ENDPOINT") or None
        self.migration_uri = os.environ.get("VGPUMGR_MIGRATION_URI") or f"qemu+ssh://{ctx.hostname}/system"
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._all = False  # the whole host is marked: `serve` publishes it at start, `invalidate()` marks it
        self._written: dict[str, GpuCapacity] = {}
        self._driver: Any = _UNREAD
        self._beats = 0
        self.last_ms = 0.0  # how long the last publish took (computing and writing)
        # told each publish's seconds and kind (change, heartbeat, full): `serve`'s /metrics histogram
        self.observe: Callable[[float, str], None] | None = None
        # sums the host's summary afresh after each change commits (PostgreSQL: a change leaves it behind)
        self.follower = Follower(ctx.cfg.db_url) if ctx.cfg.db_url.startswith("postgresql") else None

    # -- marks (cheap; under the Context's own locks or none) --------------------------------------
    def mark(self, gpu: str | None) -> None:
        if self.per_change and gpu:
            with self._lock:
                self._pending.add(gpu)

    def mark_all(self) -> None:
        if self.per_change:
            with self._lock:
                self._all = True

    @property
    def wanted(self) -> bool:
        return self.per_change and (self._all or bool(self._pending))

    # -- publishing ------------------------------------------------------------------------------
    def publish(self, s: Session, *, full: bool = False, heartbeat: bool = False) -> int:
        """Write what is marked (everything with `full`) in `s`; the number of GPU rows written."""
        if not self.enabled:
            return 0
        started = time.perf_counter()
        with self._lock:
            everything, touched = full or self._all, set(self._pending)
            self._pending.clear()
            self._all = False
        try:
            caps = self._capacity(s, everything, touched)
        except Exception as exc:  # noqa: BLE001 - the change itself must go on; the heartbeat publishes again
            log.warning("fleet: could not compute this host's capacity (%s); it is published later", exc)
            self.mark_all()
            return 0
        inv = self.ctx.snapshot().inventory
        with self._lock:
            # A full publish rewrites every row (healing any another writer left behind), except on heartbeats, which
            # rewrite everything every tenth time. Otherwise what is marked is compared with what this process last
            # wrote, and only what changed is written: a whole host marked by `invalidate()` too, which a udev event
            # calls after every mdev this host makes or removes (rewriting the host then cost a change 15-20 ms).
            # Where the host's GPUs are not those it wrote (its first publish, a GPU gone), every row is rewritten.
            due = full and not (heartbeat and self._beats % FULL_EVERY)
            heal = everything and (due or {g.address for g in caps} != set(self._written))
            changed = caps if heal or not everything else [g for g in caps if self._written.get(g.address) != g]
            counts_only = [] if heal else [g for g in changed if g.address in self._written
                                           and _type_ids(self._written[g.address]) == _type_ids(g)]
            rows = [g for g in changed if g not in counts_only]
            if everything:
                self._written = {}
            self._written.update({g.address: g for g in caps})
            self._beats += heartbeat
        # the rows commit with the change or not at all: a rolled-back transaction leaves them to the next publish
        s.info.setdefault(_ON_ROLLBACK, []).append(lambda: self._forget(caps, everything))
        host_id = self.ctx.host_id(s)
        gpu_count, vgpus = sum(1 for g in inv.gpus if not g.is_vf), len(inv.mdevs) + len(inv.vf_vgpus)
        if rows or heal or full:
            writes.lock_host(s, host_id)
            writes.write_gpus(s, host_id, rows, prune_types=True)
            if heal:
                writes.prune_gpus(s, host_id, [g.address for g in caps])
            if counts_only:
                writes.write_counts(s, host_id, counts_only, gpu_count, vgpus, host=False)
            if not writes.write_host(s, host_id, self.facts(), gpus=gpu_count, vgpus=vgpus):
                writes.refresh_types(s, host_id)  # a change left it behind, and no GPU's rows were written
        elif writes.write_counts(s, host_id, counts_only, gpu_count, vgpus) and (follower := self.follower):
            # the usual change: GPUs this process published before, one statement on PostgreSQL that takes the
            # host's lock first (one round trip); the host's summary is summed after the commit
            s.info.setdefault(_ON_COMMIT, []).append(lambda: follower.due(host_id))
        spent = time.perf_counter() - started
        self.last_ms = spent * 1000
        if self.observe is not None:
            try:
                self.observe(spent, "full" if heal else "heartbeat" if heartbeat else "change")
            except Exception:  # noqa: BLE001 - a metric must not fail the change whose transaction this is
                log.exception("fleet: could not record this publish's time")
        return len(changed)

    def _forget(self, caps: list[GpuCapacity], everything: bool) -> None:
        with self._lock:
            for g in caps:
                self._written.pop(g.address, None)
                self._pending.add(g.address)
            self._all = self._all or everything

    def _capacity(self, s: Session, everything: bool, touched: set[str]) -> list[GpuCapacity]:
        snap = self.ctx.snapshot()
        only = None if everything else touched
        gpus = [g for g in snap.inventory.gpus if only is None or g.address in only]
        # the records matter only where a GPU instance may be bound to a vGPU (MIG); elsewhere sysfs says it all
        mig = any(((g.nvml or {}).get("mig") or {}).get("current") == "enabled" for g in gpus)
        records = placed(db_store.live_rows(s, self.ctx.host_id(s))) if mig else []
        return host_capacity(snap.placer, records, only)

    def facts(self) -> writes.HostFacts:
        return writes.HostFacts(self.endpoint, self.migration_uri, self.driver_version(), code_version(),
                               self.heartbeat_s, self.stale_after_s)

    def driver_version(self) -> str | None:
        """The NVIDIA host driver's version, which is the vGPU manager's: the kernel module's own
        (/sys/module/nvidia/version), else NVML's; read once per process."""
        if self._driver is _UNREAD:
            self._driver = _driver_version(self.ctx.cfg)
        return self._driver


# What a transaction's rollback must undo in this process's memory of what it wrote, and what its commit sets
# going: kept on the session, run by one listener on every session (a listener added per change cost ~0.1 ms of
# the change's publishing)
_ON_ROLLBACK = "vgpumgr.fleet.on_rollback"
_ON_COMMIT = "vgpumgr.fleet.on_commit"


@event.listens_for(Session, "after_rollback")
def _after_rollback(s: Session) -> None:
    s.info.pop(_ON_COMMIT, None)
    for undo in s.info.pop(_ON_ROLLBACK, ()):
        undo()


@event.listens_for(Session, "after_commit")
def _after_commit(s: Session) -> None:
    s.info.pop(_ON_ROLLBACK, None)
    for then in s.info.pop(_ON_COMMIT, ()):
        then()


def _type_ids(g: GpuCapacity) -> set[str]:
    return {t.type for t in g.types}


def _driver_version(cfg: Any) -> str | None:
    path = cfg.host.root / "sys/module/nvidia/version"
    try:
        text = path.read_text().strip()
        if text:
            return text
    except OSError:
        pass
    try:
        from vgpumgr.nvidia.facts import nvml_layer

        layer = nvml_layer(cfg)
        if layer is None or not layer.open():
            return None
        try:
            value = layer.driver().get("driver_version")
        finally:
            layer.close()
        return str(value) if value else None
    except Exception:  # noqa: BLE001 - no NVML, or one that cannot answer: the version is simply not known
        return None
