"""Reservation owners and leases: who is in the middle of an operation, and rolling back after one who died.

An allocation carries an owner while an operation is in flight: from `reserve` to `activate` for a vGPU,
until the domain is defined for `vm create`, and from undefine to release for `vm delete`. The owner is a
process named by host, boot id, pid and start time (field 22 of /proc/<pid>/stat, so a reused pid is not
taken for the owner), with a lease expiry. Whoever takes the host lock next (`reap`), the service at start
and `reconcile --fix` roll back what a dead owner left: the device is removed if it exists, the record and
its licence seat released, the reason audited. A VM that libvirt does know keeps its devices: the owner died
after the domain was defined (or before it was undefined), so the records are kept and only the owner is
cleared.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.backends import nvidia_vf
from vgpumgr.config import env_seconds
from vgpumgr.db import store
from vgpumgr.db.models import ALLOC_RESERVED, utcnow
from vgpumgr.db.models import Allocation as AllocRow
from vgpumgr.errors import VgpuError
from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF
from vgpumgr.ops.context import FAILED, OK, Context
from vgpumgr.ops.records import allocation_dict

CRASH_POINT_ENV = "VGPUMGR_TEST_CRASH_POINT"  # tests only: "NAME:SECONDS" pauses there (tests/test_crash.py)
LEASE_ENV = "VGPUMGR_LEASE_SECONDS"
DEFAULT_LEASE_SECONDS = 600.0
ROLLBACK = "vgpu.rollback"
ADOPT = "vgpu.adopt"

_holding: contextvars.ContextVar[bool] = contextvars.ContextVar("vgpumgr_holding", default=False)


# -- who owns what ----------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()[:36]
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when there is no such process."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
    except (OSError, ValueError):
        return None
    # comm (field 2) may hold spaces and parentheses: the fields after it start behind the last ')'
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])  # field 22 overall
    except (IndexError, ValueError):
        return None


@lru_cache(maxsize=4)
def _me(pid: int) -> tuple[int, int | None]:
    return pid, start_time(pid)


def lease_seconds() -> float:
    return env_seconds(LEASE_ENV, DEFAULT_LEASE_SECONDS, "600")


def owner_values(svc: Context, now: datetime | None = None) -> dict[str, Any]:
    """The owner columns for an operation of this process, with a fresh lease."""
    pid, started = _me(os.getpid())  # keyed by pid: a forked child is its own owner
    return {"owner_host": svc.hostname, "owner_boot": boot_id(), "owner_pid": pid, "owner_started": started,
            "lease_until": (now or utcnow()) + timedelta(seconds=lease_seconds())}


def is_me(boot: str | None, pid: int | None, started: int | None) -> bool:
    return pid == os.getpid() and boot == boot_id() and started == _me(os.getpid())[1]


def owner_alive(boot: str | None, pid: int | None, started: int | None) -> bool:
    """Whether the process that owned a row still runs (same boot, same pid, same start time)."""
    if pid is None or boot != boot_id():
        return False
    now = start_time(pid)
    return now is not None and now == started


def why_dead(svc: Context, row: Any, now: datetime) -> str | None:
    """Why an in-flight row's owner no longer holds it, or None while it does."""
    if row.owner_pid is None:
        return "reserved with no owner (made before owners were recorded, or by a crashed older version)"
    who = f"process {row.owner_pid} on {row.owner_host}"
    if row.lease_until is not None and row.lease_until <= now:
        return f"the lease of {who} expired at {row.lease_until.isoformat(timespec='seconds')}"
    if row.owner_host != svc.hostname:
        return None  # another host's process: only its lease can say it is gone
    if row.owner_boot != boot_id():
        return f"{who} ran before the host rebooted"
    if not owner_alive(row.owner_boot, row.owner_pid, row.owner_started):
        return f"{who} is gone (killed or crashed mid-operation)"
    return None


def crash_point(name: str) -> None:
    """A named point inside a crash window. When VGPUMGR_TEST_CRASH_POINT names it, say so on stderr and
    pause, so a test can SIGKILL the process right there."""
    spec = os.environ.get(CRASH_POINT_ENV)
    if spec and spec.partition(":")[0] == name:
        os.write(2, f"vgpumgr-crash-point {name}\n".encode())
        time.sleep(float(spec.partition(":")[2] or 1.0))


# -- operations that keep their owner past activation ----------------------------------------------

@contextmanager
def holding() -> Iterator[None]:
    """Allocations made inside keep this process as their owner after activation, until `release_hold`:
    a crash before the surrounding operation finishes (e.g. the domain is defined) gets them rolled back."""
    token = _holding.set(True)
    try:
        yield
    finally:
        _holding.reset(token)


def is_holding() -> bool:
    return _holding.get()


def release_hold(svc: Context, s: Any, allocation_ids: list[int]) -> None:
    store.clear_owner(s, allocation_ids)


def take(svc: Context, allocation_ids: list[int]) -> None:
    """Own live allocations for an operation that ends with their release (vm delete)."""
    with svc.tx() as s:
        store.set_owner(s, allocation_ids, owner_values(svc))


# -- finding and rolling back what dead owners left -------------------------------------------------

@dataclass
class Dead:
    id: int
    ref: str
    state: str
    vm: str | None
    reason: str
    backend: str
    parent: str
    type: str

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "ref": self.ref, "state": self.state, "vm": self.vm, "reason": self.reason,
                "backend": self.backend, "parent": self.parent, "type": self.type}


def find_dead(svc: Context) -> list[Dead]:
    """Dead reservations of this host: one indexed query; /proc is read only for rows some operation owns.
    Call it holding the host lock (a `reserved` row is then never mid-allocation)."""
    now = utcnow()
    with svc.reads() as s:
        suspects = [(r, why_dead(svc, r, now)) for r in store.in_flight(s, svc.host_id(s))
                    if not _mine_and_leased(r, now)]
        dead = []
        for r, reason in suspects:
            if reason is None:
                continue
            row = s.get(AllocRow, r.id)
            d = allocation_dict(row, s)
            dead.append(Dead(r.id, d["uuid"] or d["pci_address"] or f"#{r.id}", r.state, d["vm"], reason,
                             row.backend, row.parent, row.type_id))
        return dead


class ReapFirst(Exception):  # noqa: N818 - a signal to the caller, not an error
    """Raised inside a transaction that found dead reservations: leave it (nothing written yet), `reap`,
    and start again."""


def check_dead(svc: Context, live: list[Any]) -> None:
    """Raise ReapFirst when this host has dead reservations among `live` (`store.live_rows`, read by the
    caller's transaction for placement too, so a clean host costs no query of its own)."""
    now = utcnow()
    for r in live:
        if store.is_in_flight(r) and not _mine_and_leased(r, now) and why_dead(svc, r, now) is not None:
            raise ReapFirst


def _mine_and_leased(row: Any, now: datetime) -> bool:
    """This process's own operation, within its lease. A lease that ran out ends even this process's hold:
    an incoming migration's reservation (owned by the service that made it) lapses when the domain never
    arrives."""
    return is_me(row.owner_boot, row.owner_pid, row.owner_started) and (
        row.lease_until is None or row.lease_until > now)


def reap(svc: Context, actor: str | None = None) -> list[dict[str, Any]]:
    """Roll back the dead reservations of this host (call with the host lock held); what was done, per row."""
    dead = find_dead(svc)
    return [roll_back(svc, d, actor) for d in dead]


def _domains_using(svc: Context, d: Dead) -> list[str]:
    if not d.vm or d.state == ALLOC_RESERVED:
        return []  # a reserved vGPU was never handed to a domain
    try:
        with svc.virt() as v:
            if d.backend == BACKEND_MDEV:
                return v.domains_using_mdev(d.ref)
            return v.domains_using_pci(d.ref)
    except VgpuError:
        return []


def roll_back(svc: Context, d: Dead, actor: str | None = None) -> dict[str, Any]:
    """Remove the device if it exists, release the record and its seat, audit why; or, if a defined domain
    uses the device, keep it and clear the dead owner."""
    domains = _domains_using(svc, d)
    if domains:
        with svc.tx() as s:
            store.clear_owner(s, [d.id])
            svc.event(s, ADOPT, OK, actor=actor, vm=d.vm, vgpu=d.ref,
                      detail={"reason": d.reason, "domains": domains, "kept": True})
        return {**d.as_dict(), "action": "kept", "domains": domains}
    removed, error = False, None
    try:
        if d.backend == BACKEND_MDEV and mdev_backend.get(svc.host, d.ref) is not None:
            mdev_backend.remove(svc.host, d.ref)
            removed = True
        elif d.backend == BACKEND_NVIDIA_VF and nvidia_vf.current(svc.host, d.ref) != 0:
            nvidia_vf.clear_type(svc.host, d.ref, retries=1)
            removed = True
    except VgpuError as e:
        error = str(e)
    if error is not None:
        with svc.tx() as s:
            svc.event(s, ROLLBACK, FAILED, actor=actor, vm=d.vm, vgpu=d.ref, error=error,
                      detail={"reason": d.reason, "state": d.state})
        return {**d.as_dict(), "action": "failed", "error": error}
    svc.invalidate()
    with svc.tx() as s:
        row = s.get(AllocRow, d.id)
        store.release(s, row)
        store.forget_idempotency_key(s, d.id)
        if d.vm:
            vm_row = store.get_vm(s, row.host_id, d.vm)
            if vm_row is not None and vm_row.state != "deleted" and not store.allocations(
                    s, row.host_id, vm=vm_row, live=True):
                vm_row.state = "deleted" if not _vm_known(svc, d.vm) else vm_row.state
        svc.event(s, ROLLBACK, OK, actor=actor, vm=d.vm, vgpu=d.ref, gpu=(row.detail or {}).get("gpu"),
                  detail={"reason": d.reason, "state": d.state, "device_removed": removed,
                          "type": d.type, "parent": d.parent, "backend": d.backend})
    return {**d.as_dict(), "action": "rolled back", "device_removed": removed}


def _vm_known(svc: Context, name: str) -> bool:
    try:
        with svc.virt() as v:
            return v.exists(name)
    except VgpuError:
        return True  # cannot tell: leave the VM's state alone


def reap_locked(svc: Context, actor: str | None = None) -> list[dict[str, Any]]:
    """Take the host lock and roll back dead reservations (the service does this when it starts)."""
    with svc.locked():
        return reap(svc, actor)


__all__ = ["ADOPT", "ROLLBACK", "Dead", "ReapFirst", "check_dead", "find_dead", "holding", "owner_values", "reap",
           "reap_locked", "roll_back", "take"]
