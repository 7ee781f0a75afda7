"""The source of a migration: `vgpumgr vm migrate NAME --to URI` (docs/sources.md §18).

1. Read what this host knows of each of the VM's vGPUs: its record, and what NVIDIA's compatibility check
   compares (NVML's metadata of the running vGPU where NVML gives it, the board, the vGPU manager version),
   as each record's `migration` entry in the domain's vgpumgr metadata.
   It goes in the XML libvirt hands the destination (VIR_MIGRATE_PARAM_DEST_XML); the source's definition
   is not changed.
2. Preflight: when the destination's vgpumgr service is named (`--to-api`), ask it where each vGPU would
   land and why not; refuse before anything starts when one cannot.
3. libvirt's peer-to-peer migration (live, or `--offline` for a VM that is shut off), persistent at the
   destination and undefined here, post-copy never; progress from libvirt's job statistics. The
   destination's `migrate begin` hook reserves the vGPUs there (and refuses early: then libvirt cancels and
   the VM runs on here, unchanged).
4. The VM runs there: its vGPUs here are released (a source `release end` hook may have done it already),
   the destination is told the migration settled, and the audit log tells it with the migration id that the
   destination's events carry too.
"""

from __future__ import annotations

import time
import uuid as uuidlib
from collections.abc import Callable
from typing import Any

from vgpumgr import ids
from vgpumgr.errors import Conflict, InvalidInput, NotFound, VgpuError
from vgpumgr.fleet.remote import Remote
from vgpumgr.model import BACKEND_PASSTHROUGH
from vgpumgr.nvidia import migration as nvmig
from vgpumgr.ops import allocate as alloc
from vgpumgr.ops.allocate import Owner
from vgpumgr.ops.context import Context
from vgpumgr.ops.records import metadata_for
from vgpumgr.virt import migration_xml as migration
from vgpumgr.virt.domain import NS, read_allocations

MIGRATE = "vm.migrate"
RUNNING = ("running", "paused", "blocked")


def _facts(svc: Context, a: dict[str, Any], dom_uuid: str | None, mid: str, layer: Any) -> dict[str, Any]:
    gpu = svc.snapshot().inventory.gpu(a["gpu"]) if a.get("gpu") else None
    type_id = ids.nvidia_type_id(a["type"]) if str(a.get("type", "")).startswith("nvidia-") else None
    facts = {"id": mid, "from_host": svc.hostname, "allocation_id": a["id"],
             "device_id": gpu.device_id if gpu else None, "gpu_name": gpu.name if gpu else None,
             "mig_profile": a.get("mig_profile")}
    if a.get("gpu") and type_id is not None:
        facts.update(nvmig.source_facts(layer, a["gpu"], mdev_uuid=a.get("uuid"), vm_uuid=dom_uuid, type_id=type_id))
    return facts


def _records_with_facts(xml: str, records: list[dict[str, Any]], facts: dict[str, dict[str, Any]]
                        ) -> list[dict[str, Any]]:
    """The domain's vgpumgr records (one per live allocation, made from the record where the domain has none),
    each with what the destination needs to know."""
    by_ref = {r.get("uuid") or r.get("pci_address"): r for r in read_allocations(xml)}
    out = []
    for a in records:
        ref = a.get("uuid") or a.get("pci_address")
        rec = dict(by_ref.pop(ref, None) or metadata_for(a))
        rec[migration.MIGRATION_KEY] = {k: v for k, v in facts[ref].items()
                                        if k in migration.FACT_KEYS and v is not None}
        out.append(rec)
    return out + list(by_ref.values())


def _with_metadata(xml: str, records: list[dict[str, Any]]) -> str:
    from lxml import etree

    from vgpumgr.virt.domain import parse_xml

    root = parse_xml(xml)
    meta = root.find("metadata")
    if meta is None:
        meta = etree.SubElement(root, "metadata")
    for old in meta.findall(f"{{{NS}}}vm"):
        meta.remove(old)
    meta.append(etree.fromstring(migration.metadata_xml(records)))
    return etree.tostring(root, encoding="unicode")


def _refusals(report: dict[str, Any]) -> list[str]:
    return [f"{v.get('kind')} {v.get('ref')} ({v.get('type_name') or v.get('type')}): {v.get('reason')}"
            for v in report.get("vgpus", []) if not v.get("ok")]


def migrate_vm(svc: Context, name: str, to: str, *, offline: bool = False, dry_run: bool = False,
               dest: Remote | None = None, progress: Callable[[dict[str, Any]], None] | None = None,
               actor: str | None = None) -> dict[str, Any]:
    name = ids.vm_name(name)
    if not to or any(c.isspace() for c in to):
        raise InvalidInput(f"'{to}' is not a libvirt URI", hint="give the destination as qemu+ssh://HOST/system")
    virt = svc.virt()
    if not virt.exists(name):
        raise NotFound(f"no VM {name}", hint="`vgpumgr vm list` shows the VMs")
    state = virt.state(name)
    if offline and state in RUNNING:
        raise Conflict(f"VM {name} is {state}; --offline moves a VM that is shut off",
                       hint=f"stop it first (`vgpumgr vm stop {name}`), or migrate it live without --offline")
    if not offline and state not in RUNNING:
        raise Conflict(f"VM {name} is {state}: a live migration needs a running VM",
                       hint="start it, or move its definition and records with --offline")
    records = alloc.allocations(svc, vm=name, live=True)
    whole = [a["pci_address"] for a in records if a["backend"] == BACKEND_PASSTHROUGH]
    if whole and not offline:
        raise Conflict(f"VM {name} has the whole GPU {', '.join(whole)} passed through: its state cannot move with a "
                       "live migration", hint="shut the VM down and migrate it with --offline")
    dom_uuid = next((d["uuid"] for d in virt.list() if d["name"] == name), None)
    mid = uuidlib.uuid4().hex[:12]
    layer = _nvml(svc)
    facts = {a.get("uuid") or a.get("pci_address"): _facts(svc, a, dom_uuid, mid, layer) for a in records}
    xml = virt.xml(name, inactive=offline, migratable=True)
    meta_records = _records_with_facts(xml, records, facts)
    full_xml = _with_metadata(xml, meta_records)
    report = dest.preflight(name, full_xml) if dest is not None and records else None
    result: dict[str, Any] = {
        "vm": name, "to": to, "migration": mid, "offline": offline, "vgpus": [_brief(a, facts) for a in records],
        "preflight": report if report is not None else (
            {"note": "the destination's vgpumgr was not asked (no --to-api): its migrate-begin hook checks"}
            if records else {"note": "the VM has no vGPU"})}
    refusals = _refusals(report) if report else []
    if dry_run:
        return {**result, "ok": not refusals, "refusals": refusals}
    if refusals:
        err = Conflict(f"{to} cannot take VM {name}: " + "; ".join(refusals),
                       hint="`vgpumgr vm migrate --dry-run` shows each vGPU's candidates; pick another destination")
        svc.record_failure(MIGRATE, err, actor=actor, vm=name, detail={"migration": mid, "to": to, "preflight": True})
        raise err
    started = time.monotonic()
    try:  # the facts travel in the XML the destination gets; the source's own definition stays as it was
        transport = svc.host.kernel.migration_transport(to)
        send = full_xml if records else None
        stats = (transport.migrate(svc, name, to, xml=send, offline=offline, progress=progress)
                 if transport is not None else virt.migrate(name, to, xml=send, offline=offline, progress=progress))
    except VgpuError as e:
        svc.record_failure(MIGRATE, e, actor=actor, vm=name, detail={"migration": mid, "to": to, "offline": offline})
        raise
    svc.invalidate()
    released, errors = [], []
    if transport is None and not offline and records:
        errors += _fix_persistent_definition(to, name)
    for a in records:
        ref = a.get("uuid") or a.get("pci_address")
        try:
            alloc.release(svc, ref, actor=actor, owner=Owner(name, allocation_id=a["id"]))
            released.append(ref)
        except NotFound:
            released.append(ref)  # the source's `release end` hook released it already
        except VgpuError as e:
            errors.append({"vgpu": ref, "error": e.message, "hint": e.hint})
    settled = None
    if dest is not None and records:
        try:
            settled = dest.settle(name).get("settled")
        except VgpuError as e:  # the destination's lease settles it anyway; say so
            errors.append({"vgpu": None, "error": f"the destination was not told the migration finished: {e.message}",
                           "hint": "its vGPUs become plain records when their lease runs out"})
    took = round(time.monotonic() - started, 3)
    with svc.tx() as s:
        svc.event(s, MIGRATE, actor=actor, vm=name,
                  detail={"migration": mid, "to": to, "offline": offline, "seconds": took,
                          "vgpus": result["vgpus"], "released": released, "errors": errors,
                          "downtime_ms": stats.get("downtime") if stats else None})
    return {**result, "ok": not errors, "seconds": took, "released": released, "settled": settled,
            "errors": errors, "stats": stats or {}}


def _fix_persistent_definition(to: str, name: str) -> list[dict[str, Any]]:
    """Point the destination's persistent definition at the vGPUs the domain got there (see
    migration.persistent_fix); a failure is reported, the VM runs on regardless."""
    from vgpumgr.virt.driver import Virt

    try:
        with Virt(to) as v:
            fixed = migration.persistent_fix(v.xml(name, inactive=True), v.xml(name, migratable=True))
            if fixed is not None:
                v.define(fixed, replace=True, validate=False)
    except VgpuError as e:
        return [{"vgpu": None, "error": f"the persistent definition at {to} still names this host's vGPUs: {e.message}",
                 "hint": f"redefine it there from the running domain (virsh -c {to} dumpxml {name})"}]
    return []


def _brief(a: dict[str, Any], facts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ref = a.get("uuid") or a.get("pci_address")
    f = facts.get(ref, {})
    return {"ref": ref, "backend": a["backend"], "type": a["type"], "type_name": a.get("type_name"),
            "gpu": a.get("gpu"), "nvml": f.get("nvml", "absent"), "host_driver": f.get("host_driver")}


def _nvml(svc: Context) -> Any:
    from vgpumgr.nvidia.facts import nvml_layer

    return nvml_layer(svc.cfg)

