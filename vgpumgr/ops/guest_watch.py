"""Which VMs vgpumgr reads from inside their guests (guest-side telemetry), opt-in (docs/sources.md §25).

Running a command in a tenant's guest is root in that guest (qemu-ga runs as root) and taints the domain in
libvirt's log, so nothing is read unless an operator chose it: for one VM (`guests telemetry VM on|off`) or for
the VMs holding a seat of a licence pool (`guests telemetry --pool P on|off`). A VM's own choice wins over its
pool's; without either it is off. Each change is audited.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from vgpumgr import ids
from vgpumgr.db.models import GuestTelemetry, LicenceLease, Vm
from vgpumgr.errors import InvalidInput
from vgpumgr.licensing import seats as licensing
from vgpumgr.ops.context import Context

SET = "guest.telemetry.set"
CHOICES = {"on": True, "off": False, "default": None}


def _choice(value: str) -> bool | None:
    if value not in CHOICES:
        raise InvalidInput(f"guest telemetry '{value}' is not a choice", hint="use on, off or default")
    return CHOICES[value]


def set_vm(svc: Context, vm: str, value: str, *, actor: str | None = None) -> dict[str, Any]:
    """Choose for one VM (`default`: its pool's choice, else off)."""
    enabled = _choice(value)
    name = ids.vm_name(vm)
    with svc.tx() as s:
        row = s.scalar(select(GuestTelemetry).where(GuestTelemetry.vm == name))
        if enabled is None:
            if row is not None:
                s.delete(row)
        elif row is None:
            s.add(GuestTelemetry(vm=name, enabled=enabled))
        else:
            row.enabled = enabled
        svc.event(s, SET, actor=actor, vm=name, detail={"vm": name, "telemetry": value})
    return {"vm": name, "telemetry": value}


def set_pool(svc: Context, pool: str, value: str, *, actor: str | None = None) -> dict[str, Any]:
    enabled = _choice(value)
    with svc.tx() as s:
        p = licensing.get_pool(s, pool)
        row = s.scalar(select(GuestTelemetry).where(GuestTelemetry.pool_id == p.id))
        if enabled is None:
            if row is not None:
                s.delete(row)
        elif row is None:
            s.add(GuestTelemetry(pool_id=p.id, enabled=enabled))
        else:
            row.enabled = enabled
        svc.event(s, SET, actor=actor, detail={"pool": pool, "telemetry": value})
    return {"pool": pool, "telemetry": value}


def _pool_vms(s: Session, host_id: int) -> dict[str, list[int]]:
    """VM name -> the pools its held seats come from (this host's VMs)."""
    out: dict[str, list[int]] = {}
    rows = s.execute(select(Vm.name, LicenceLease.pool_id).join(LicenceLease, LicenceLease.vm_id == Vm.id)
                     .where(Vm.host_id == host_id, LicenceLease.released_at.is_(None)))
    for name, pool_id in rows:
        out.setdefault(name, []).append(pool_id)
    return out


def choices(svc: Context) -> dict[str, Any]:
    """{"vms": {name: bool}, "pools": {name: bool}}: every choice made."""
    with svc.reads() as s:
        rows = list(s.scalars(select(GuestTelemetry)))
        pools = {p.id: p.name for p in licensing.list_pools(s)} if any(r.pool_id for r in rows) else {}
    return {"vms": {r.vm: r.enabled for r in rows if r.vm},
            "pools": {pools.get(r.pool_id, str(r.pool_id)): r.enabled for r in rows if r.pool_id}}


def enabled_vms(svc: Context, names: list[str]) -> dict[str, str]:
    """Of the VMs `names` (running here), those to read from inside, with where that was chosen ("vm", "pool P")."""
    with svc.reads() as s:
        rows = list(s.scalars(select(GuestTelemetry)))
        if not rows:
            return {}
        by_vm = {r.vm: r.enabled for r in rows if r.vm}
        by_pool = {r.pool_id: r.enabled for r in rows if r.pool_id}
        seats = _pool_vms(s, svc.host_id(s)) if by_pool else {}
        pool_names = {p.id: p.name for p in licensing.list_pools(s)} if by_pool else {}
    out = {}
    for name in names:
        if name in by_vm:
            if by_vm[name]:
                out[name] = "vm"
            continue
        on = [p for p in seats.get(name, []) if by_pool.get(p)]
        if on:
            out[name] = f"pool {pool_names.get(on[0], on[0])}"
    return out
