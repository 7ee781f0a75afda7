"""The destination of a live migration: reserve matching vGPUs for an incoming domain, rewrite its XML,
activate them when the domain starts here (docs/sources.md §18).

libvirt's `migrate begin` hook (and `restore begin`) hands the incoming domain XML to `receive`. Per vGPU
hostdev: an mdev keeps its UUID where that is free here, else gets a new one; an NVIDIA vendor VF becomes a
free VF of the same type; a MIG-backed vGPU (known by its type's name, vgpumgr's record or the source's
facts, so also when plain libvirt, Nova or Proxmox started the migration) gets a GPU instance of the same
profile (made if needed); a whole GPU passed through is refused. Only GPUs NVIDIA allows the vGPU to continue
on are candidates (NVML's compatibility answer, else the documented rules). Everything is reserved or nothing:
a refusal names every reason and leaves nothing behind. The reservations stay *reserved*, owned by this
service with a short lease (`VGPUMGR_INCOMING_GRACE`, default 120 s: `migrate begin` and `prepare begin`
follow each other at once); `arrived` (from `prepare begin`) activates them, still owned until the source's
`vm migrate` reports success (`settle`) or the lease runs out: the dead-owner check then keeps what a domain
here uses and rolls back the rest, so a migration that never arrives, or was killed halfway, leaves nothing.
A failed migration ends with `release end`, which releases them.

On a database the source shares (a fleet), each vGPU shares the source allocation's licence seat, and the
seat moves to the VM's row here when it arrives: a migration never takes a second seat.
"""

from __future__ import annotations

import uuid as uuidlib
from datetime import timedelta
from typing import Any

from sqlalchemy import select

from vgpumgr import ids
from vgpumgr.backends import nvidia_vf
from vgpumgr.config import env_seconds
from vgpumgr.db import store
from vgpumgr.db.models import ALLOC_RESERVED, LIVE_STATES, utcnow
from vgpumgr.db.models import Allocation as AllocRow
from vgpumgr.db.models import Host as HostRow
from vgpumgr.errors import Conflict, InvalidInput, NoCapacity, NotFound, VgpuError
from vgpumgr.licensing import seats as licensing
from vgpumgr.model import BACKEND_MDEV, BACKEND_PASSTHROUGH
from vgpumgr.nvidia import migration as nvmig
from vgpumgr.ops import allocate as alloc
from vgpumgr.ops import leases
from vgpumgr.ops import mig as mig_ops
from vgpumgr.ops.allocate import Owner
from vgpumgr.ops.context import FAILED, Context
from vgpumgr.ops.records import metadata_for
from vgpumgr.placement.placer import Policy
from vgpumgr.virt import migration_xml as migration

INCOMING = "vgpu.incoming"
ARRIVED = "vm.migrated-in"
GRACE_ENV = "VGPUMGR_INCOMING_GRACE"


def grace_seconds() -> float:
    return env_seconds(GRACE_ENV, 120.0, "120")


def _short(name: str | None) -> str:
    return (name or "").strip().split()[-1] if name else ""


def _candidates(svc: Context, v: migration.IncomingVgpu, layer: Any) -> dict[str, Any]:
    """{GPU address: compat.Verdict} for each physical GPU here that could take the vGPU's type."""
    inv = svc.snapshot().inventory
    want = _short(v.type_name)
    offered: dict[str, str | None] = {}
    for t in inv.types:
        if t.gpu and want and _short(t.name) == want:
            offered[t.gpu] = t.name
    if v.mig_profile and layer is not None:  # MIG-backed types show up only once a GPU instance exists
        for address, g in layer.gpus().items():
            if (g.get("mig") or {}).get("current") == "enabled":
                names = [x.get("name") for x in (g.get("vgpu") or {}).get("supported_types") or []]
                offered.setdefault(address, next((n for n in names if _short(n) == want), None))
    verdicts = {}
    for address, name in sorted(offered.items()):
        gpu = inv.gpu(address)
        cand = nvmig.candidate(layer, address, gpu.device_id if gpu else None, gpu.name if gpu else None)
        verdicts[address] = nvmig.verdict(layer, cand, v.migrating(), name, v.facts.get("nvml_metadata"))
    return verdicts


def _source_lease(svc: Context, facts: dict[str, Any]) -> int | None:
    """The seat of the source's allocation, when this database is the source's too (a fleet)."""
    source_id, source_host = facts.get("allocation_id"), facts.get("from_host")
    if not isinstance(source_id, int) or not source_host or source_host == svc.hostname:
        return None
    with svc.reads() as s:
        row = s.execute(select(AllocRow.lease_id).join(HostRow, HostRow.id == AllocRow.host_id)
                        .where(AllocRow.id == source_id, HostRow.name == source_host,
                               AllocRow.state.in_(LIVE_STATES))).first()
    return row[0] if row is not None else None


def _refusal(v: migration.IncomingVgpu, verdicts: dict[str, Any]) -> str:
    bad = [f"{gpu}: {verdict.reason}" for gpu, verdict in verdicts.items() if not verdict.live]
    what = v.type_name or v.record.get("type") or v.kind
    if not verdicts:
        return f"no GPU here offers vGPU type {what}"
    return f"no GPU here may take the {what} vGPU {v.ref} live" + (f" ({'; '.join(bad)})" if bad else "")


def _reserve_one(svc: Context, domain: str, v: migration.IncomingVgpu, mid: str, verdicts: dict[str, Any],
                 actor: str | None) -> dict[str, Any]:
    denied = frozenset(g for g, verdict in verdicts.items() if not verdict.live)
    if verdicts and len(denied) == len(verdicts):
        raise NoCapacity(_refusal(v, verdicts), hint="NVIDIA allows a live migration only to the same vGPU type on "
                                                     "the same board with the same vGPU manager version")
    facts = v.facts
    detail = {"incoming": {"migration": mid, "from": facts.get("from_host"), "source": v.ref,
                           "source_allocation": facts.get("allocation_id")}}
    lease_id = _source_lease(svc, facts)
    policy = Policy(deny_gpus=denied)
    try:
        if v.mig_profile:
            return mig_ops.allocate_mig(svc, v.mig_profile, vm=domain, policy=policy, actor=actor, detail=detail,
                                        lease_id=lease_id, activate=False, series=_series(v))
        uuid = v.ref if v.kind == BACKEND_MDEV and not _uuid_taken(svc, v.ref) else None
        return alloc.allocate(svc, _placeable(v), vm=domain, uuid=uuid, policy=policy,
                              actor=actor, detail=detail, lease_id=lease_id, activate=False)
    except NoCapacity as e:
        extra = [f"{g}: {verdict.reason}" for g, verdict in verdicts.items() if not verdict.live]
        raise NoCapacity(e.message + (f"; not allowed for a live migration: {'; '.join(extra)}" if extra else ""),
                         hint=e.hint) from e


def _series(v: migration.IncomingVgpu) -> str | None:
    parsed = ids.parse_type_name(v.type_name or "")
    return parsed.series if parsed else None


def _placeable(v: migration.IncomingVgpu) -> str:
    """What placement is asked for: NVIDIA's type name (its ids differ from one GPU model to the next), any
    other type by its id (mtty-2 means the same on every host; its name, "Dual port serial", may not be unique)."""
    type_id = str(v.record.get("type") or "")
    return v.type_name if type_id.startswith("nvidia-") or not type_id else type_id


def _uuid_taken(svc: Context, uuid: str) -> bool:
    if svc.host.mdev(uuid).exists():  # the kernel's own answer, without re-reading the host
        return True
    with svc.reads() as s:
        return store.live_allocation(s, svc.host_id(s), uuid=uuid) is not None


def _migration_id(vgpus: list[migration.IncomingVgpu]) -> str:
    found = next((v.facts.get("id") for v in vgpus if v.facts.get("id")), None)
    return str(found) if found else uuidlib.uuid4().hex[:12]


def _pending(svc: Context, domain: str, mid: str) -> list[dict[str, Any]]:
    return [a for a in alloc.allocations(svc, vm=domain, live=True) if a.get("incoming", {}).get("migration") == mid]


def _not_cordoned(svc: Context) -> None:
    from vgpumgr.ops.cordon import host_status

    st = host_status(svc)
    if st["cordoned"]:
        raise Conflict(f"host {st['host']} is cordoned{': ' + st['reason'] if st['reason'] else ''}; it takes no "
                       "incoming migrations", hint="choose another destination, or `vgpumgr host uncordon` there")


def _checked(svc: Context, domain: str, xml: str) -> list[migration.IncomingVgpu]:
    """The incoming vGPUs this host must reserve. A vGPU the XML already points at here is left as it is: one
    this host recorded for the same VM (prepared before the migration, as Nova and KubeVirt do), or a device
    that exists here without a record of ours (another manager's, as at `prepare begin`)."""
    vgpus = migration.incoming_vgpus(xml)
    if vgpus:
        _not_cordoned(svc)
    wanted = []
    for v in vgpus:
        if v.kind == BACKEND_PASSTHROUGH:
            raise Conflict(f"the domain passes the whole GPU {v.ref} through: a passed-through GPU's state cannot "
                           "move with a live migration", hint="shut the VM down and migrate it with --offline, or "
                                                             "detach the GPU first")
        if _here_already(svc, domain, v):
            continue
        if not (v.type_name or v.record.get("type")):
            raise InvalidInput(f"the domain's {v.kind} {v.ref} carries no vgpumgr record naming its vGPU type",
                               hint="migrate VMs made by vgpumgr, or add the type to the domain's vgpumgr metadata")
        _ = v.mig_profile  # a malformed or contradictory profile is refused before anything is reserved
        wanted.append(v)
    return wanted


def _here_already(svc: Context, domain: str, v: migration.IncomingVgpu) -> bool:
    if v.facts.get("from_host"):  # vgpumgr's source sent it: its refs are the source's, never ours
        return False
    try:
        rec = alloc.find_allocation(svc, v.ref)
    except NotFound:
        if v.type_name or v.record.get("type"):
            return False  # a vgpumgr vGPU from elsewhere: it gets its own here (a new UUID where this one is taken)
        if v.kind == BACKEND_MDEV:  # the kernel's own answer, without re-reading the host
            return svc.host.mdev(v.ref).exists()
        return nvidia_vf.current(svc.host, v.ref) != 0  # a VF that holds a vGPU type
    return rec["vm"] == domain


def preflight(svc: Context, domain: str, xml: str) -> dict[str, Any]:
    """Where each vGPU of the incoming domain would land here, and why not: changes nothing."""
    domain = ids.vm_name(domain)
    vgpus = _checked(svc, domain, xml)
    layer = _layer(svc)
    out = []
    for v in vgpus:
        verdicts = _candidates(svc, v, layer)
        allowed = [g for g, verdict in verdicts.items() if verdict.live]
        entry = {**v.as_dict(), "candidates": {g: verdict.as_dict() for g, verdict in verdicts.items()}}
        if not allowed:
            entry.update(ok=False, reason=_refusal(v, verdicts))
        elif v.mig_profile:
            entry.update(_mig_preflight(svc, domain, v.mig_profile, frozenset(set(verdicts) - set(allowed)), layer))
        else:
            decision = svc.place(_placeable(v), domain,
                                 Policy(deny_gpus=frozenset(set(verdicts) - set(allowed))))
            c = decision.choice
            entry.update(ok=c is not None, gpu=c.gpu if c else None, parent=c.parent if c else None,
                         reason=None if c else decision.summary())
        out.append(entry)
    return {"vm": domain, "ok": all(e["ok"] for e in out), "vgpus": out,
            "nvml": None if layer is not None and layer.open() else "NVML unavailable here: documented rules apply"}


def _mig_preflight(svc: Context, domain: str, profile: str, denied: frozenset[str], layer: Any) -> dict[str, Any]:
    """Where a MIG-backed vGPU would get its GPU instance here (reused or made), or the true reason why not."""
    if layer is None or not layer.open():
        return {"ok": True, "note": "NVML unavailable here: a GPU instance of the same profile is reused or made"}
    try:
        gpu, make = mig_ops.choose_gpu(svc, layer, profile, Policy(deny_gpus=denied), domain)
    except NoCapacity as e:
        return {"ok": False, "reason": e.message}
    return {"ok": True, "gpu": gpu, "note": f"a {profile} GPU instance is {'made' if make else 'reused'}"}


def receive(svc: Context, domain: str, xml: str, *, actor: str | None = None) -> dict[str, Any]:
    """Reserve this host's vGPUs for an incoming domain; returns {"xml": the rewritten XML (None when the
    domain has no vGPU), "vgpus": [...]}. Raises with every reason when this host cannot take it."""
    domain = ids.vm_name(domain)
    vgpus = _checked(svc, domain, xml)
    if not vgpus:
        return {"vm": domain, "xml": None, "vgpus": [], "migration": None}
    mid = _migration_id(vgpus)
    layer = _layer(svc)
    with svc.locked():
        made = _pending(svc, domain, mid)  # a retried hook call: the same migration keeps its vGPUs
        if len(made) != len(vgpus):
            made = _reserve_all(svc, domain, vgpus, mid, layer, actor)
    by_source = {a["incoming"]["source"]: a for a in made}
    chosen = {}
    for v in vgpus:
        a = by_source[v.ref]
        chosen[v.ref] = {**metadata_for(a), migration.MIGRATION_KEY: {"id": mid, "from_host": v.facts.get("from_host")}}
    return {"vm": domain, "migration": mid, "xml": migration.rewrite(xml, chosen),
            "vgpus": [{"source": v.ref, **_brief(by_source[v.ref])} for v in vgpus]}


def _brief(a: dict[str, Any]) -> dict[str, Any]:
    return {k: a.get(k) for k in ("id", "uuid", "pci_address", "parent", "gpu", "type", "type_name", "state")}


def _reserve_all(svc: Context, domain: str, vgpus: list[migration.IncomingVgpu], mid: str, layer: Any,
                 actor: str | None) -> list[dict[str, Any]]:
    for stale in _pending(svc, domain, mid):  # a partial earlier attempt: start again from nothing
        _undo(svc, stale, actor)
    made: list[dict[str, Any]] = []
    mig_layer = _mig_layer(svc) if any(v.mig_profile for v in vgpus) else None
    instances_before = mig_ops.instance_ids(mig_layer) if mig_layer is not None else set()
    try:
        for v in vgpus:
            made.append(_reserve_one(svc, domain, v, mid, _candidates(svc, v, layer), actor))
    except VgpuError as e:
        for a in made:
            _undo(svc, a, actor)
        if mig_layer is not None:  # the GPU instances made for this migration go with its vGPUs
            mig_ops.destroy_made_since(svc, mig_layer, instances_before, actor=actor, vm=domain)
        with svc.tx() as s:
            svc.event(s, INCOMING, FAILED, actor=actor, vm=domain, error=e.message,
                      detail={"migration": mid, "vgpus": [v.as_dict() for v in vgpus]})
        raise
    until = utcnow() + timedelta(seconds=grace_seconds())
    with svc.tx() as s:
        store.set_owner(s, [a["id"] for a in made], {**leases.owner_values(svc), "lease_until": until})
        for v, a in zip(vgpus, made, strict=True):
            svc.event(s, INCOMING, actor=actor, gpu=a.get("gpu"), vm=domain, vgpu=a.get("uuid") or a.get("pci_address"),
                      detail={"migration": mid, "from": v.facts.get("from_host"), "source": v.ref,
                              "type": a.get("type"), "name": a.get("type_name"),
                              "shared_seat": _source_lease(svc, v.facts) is not None})
    return [{**a, "incoming": {"migration": mid, "source": v.ref}} for v, a in zip(vgpus, made, strict=True)]


def _mig_layer(svc: Context) -> Any:
    try:
        return svc.nvml()
    except VgpuError:
        return None  # no NVML: no GPU instance can be made either (allocate_mig says so)


def _undo(svc: Context, a: dict[str, Any], actor: str | None) -> None:
    try:
        alloc.release(svc, a.get("uuid") or a["pci_address"], actor=actor, check_libvirt=False,
                      owner=Owner(a["vm"], allocation_id=a["id"]))
    except NotFound:
        pass


def arrived(svc: Context, domain: str, *, actor: str | None = None) -> list[int]:
    """The domain is starting here (`prepare begin`): its incoming reservations become active and their
    seats move to its row here. Returns the activated allocation ids (none for an ordinary start)."""
    domain = ids.vm_name(domain)
    done = []
    with svc.tx() as s:
        h = svc.host_id(s)
        vm_row = store.get_vm(s, h, domain)
        if vm_row is None:
            return []
        rows = s.scalars(select(AllocRow).where(AllocRow.host_id == h, AllocRow.vm_id == vm_row.id,
                                                AllocRow.state == ALLOC_RESERVED)).all()
        for row in rows:
            incoming = (row.detail or {}).get("incoming")
            if not incoming:
                continue
            store.activate(s, row, keep_owner=True)  # still owned (leased) until the migration settles
            moved = row.lease_id is not None and licensing.move(
                s, row.lease_id, vm_row, store.gpu_by_address(s, h, (row.detail or {}).get("gpu") or ""))
            svc.event(s, ARRIVED, actor=actor, gpu=(row.detail or {}).get("gpu"), vm=domain,
                      vgpu=row.uuid or row.pci_address,
                      detail={"migration": incoming.get("migration"), "from": incoming.get("from"),
                              "source": incoming.get("source"), "seat_moved": moved})
            done.append(row.id)
    return done


def settle(svc: Context, domain: str, *, actor: str | None = None) -> list[int]:
    """The migration finished (the source's `vm migrate` says so): the vGPUs that arrived (an offline migration's
    too, whose domain never started here) are plain active records now.
    Without this call the same happens when their lease runs out: the dead-owner check finds the domain
    using them and keeps them (`vgpu.adopt`); a migration that never finished finds none and rolls back."""
    domain = ids.vm_name(domain)
    arrived(svc, domain, actor=actor)  # an offline migration never starts the domain here: it arrived all the same
    with svc.tx() as s:
        h = svc.host_id(s)
        vm_row = store.get_vm(s, h, domain)
        if vm_row is None:
            raise NotFound(f"no VM {domain} on this host", hint="nothing migrated here under that name")
        rows = s.scalars(select(AllocRow).where(AllocRow.host_id == h, AllocRow.vm_id == vm_row.id,
                                                AllocRow.state.in_(LIVE_STATES), AllocRow.owner_pid.is_not(None))
                         ).all()
        ids_ = [r.id for r in rows if (r.detail or {}).get("incoming") and r.state != ALLOC_RESERVED]
        store.clear_owner(s, ids_)
    return ids_


def _layer(svc: Context) -> Any:
    from vgpumgr.nvidia.facts import nvml_layer

    return nvml_layer(svc.cfg)
