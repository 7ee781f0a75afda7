"""What the host-side hooks ask for, composed from Service calls: ensure a vGPU exists, release a VM's vGPUs.

Hooks are retried and re-run (every VM start, after a host reboot), so each operation is idempotent by the
mdev UUID: a live record whose device exists is returned as it is; a live record whose device vanished (host
reboot) is released and created again with the same UUID on the same parent.
"""

from __future__ import annotations

from typing import Any

from vgpumgr import ids
from vgpumgr.errors import Conflict, InvalidInput, NotFound, VgpuError
from vgpumgr.placement import Policy
from vgpumgr.service import Service


def _live(service: Service, uuid: str) -> dict[str, Any] | None:
    try:
        return service.find_allocation(uuid)
    except NotFound:
        return None


def _present(service: Service, uuid: str) -> bool:
    inv = service.snapshot(refresh=True).inventory
    return any(m.uuid == uuid for m in inv.mdevs)


def ensure(service: Service, *, uuid: str, type_name: str, vm: str, parent: str | None = None,
           idempotency_key: str | None = None, actor: str | None = None) -> tuple[dict[str, Any], bool]:
    """(allocation, created) for the mdev `uuid` of `vm`."""
    uuid, vm = ids.mdev_uuid(uuid), ids.vm_name(vm)
    parent = ids.parent_name(parent) if parent else None
    rec = _live(service, uuid)
    if rec is not None:
        if rec["vm"] != vm:
            raise Conflict(f"vGPU {uuid} belongs to VM {rec['vm']}, not {vm}",
                           hint="release it from that VM first (`vgpumgr vgpu remove`)", vm=rec["vm"])
        if _present(service, uuid):
            return rec, False
        # The record outlived its device (host reboot): create it again where it was.
        parent = parent or rec["parent"]
        type_name = type_name or rec["type"]
        service.release(uuid, actor=actor)
    elif _present(service, uuid):
        raise Conflict(f"mdev {uuid} exists but vgpumgr has no record of it",
                       hint="`vgpumgr reconcile` lists unknown devices; remove it or let vgpumgr adopt it", uuid=uuid)
    policy = Policy(pin_parent=parent) if parent else None
    try:
        return service.allocate(type_name, vm=vm, uuid=uuid, policy=policy, idempotency_key=idempotency_key,
                                actor=actor), True
    except Conflict:
        rec = _live(service, uuid)  # a concurrent retry of the same request won the race
        if rec is not None and rec["vm"] == vm:
            return rec, False
        raise


def release_vm(service: Service, vm: str, uuids: list[str] | None = None, *, grace: float = 0.0,
               actor: str | None = None, check_libvirt: bool = True) -> dict[str, Any]:
    """Release the live vGPUs of `vm` (only `uuids` when given). Errors are collected, not raised."""
    vm = ids.vm_name(vm)
    wanted = {ids.mdev_uuid(u) for u in uuids} if uuids is not None else None
    released, errors = [], []
    for a in service.allocations(vm=vm, live=True):
        ref = a.get("uuid") or a.get("pci_address")
        if wanted is not None and a.get("uuid") not in wanted:
            continue
        try:
            service.release(ref, actor=actor, grace=grace, check_libvirt=check_libvirt)
            released.append(ref)
        except NotFound:
            continue  # released meanwhile
        except VgpuError as e:
            errors.append({"vgpu": ref, "error": e.message, "hint": e.hint})
    return {"vm": vm, "released": released, "errors": errors}


def _domain_mdevs(xml: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
    from vgpumgr.domain import read_allocations, referenced_devices

    try:
        uuids = referenced_devices(xml)["mdev"]
        meta = {r["uuid"]: r for r in read_allocations(xml) if isinstance(r.get("uuid"), str)}
    except VgpuError:
        raise
    except Exception as exc:  # lxml parse errors and the like: the caller sent something that is not a domain
        raise InvalidInput(f"the domain XML cannot be read: {exc}", hint="pass the XML libvirt gives the hook") from exc
    return uuids, meta


def libvirt_prepare(service: Service, domain: str, xml: str, *, actor: str | None = None,
                    key_prefix: str | None = None) -> dict[str, Any]:
    """Before a domain starts: each mdev it names must exist (re-created from records or its metadata)."""
    domain = ids.vm_name(domain)
    uuids, meta = _domain_mdevs(xml)
    present = {m.uuid for m in service.snapshot(refresh=True).inventory.mdevs}
    ready, created = [], []
    for n, uuid in enumerate(uuids):
        rec = _live(service, uuid)
        m = meta.get(uuid, {})
        type_name = m.get("type") or (rec or {}).get("type")
        parent = m.get("parent") or (rec or {}).get("parent")
        if rec is None and uuid in present:
            ready.append(uuid)  # an mdev someone else manages: not ours to judge
            continue
        if not type_name:
            raise NotFound(f"domain {domain} uses mdev {uuid}, which does not exist, and neither vgpumgr's records "
                           "nor the domain's metadata say what it should be",
                           hint="create it (`vgpumgr vgpu create --uuid ...`) or remove the hostdev", uuid=uuid)
        key = f"{key_prefix}-{n}" if key_prefix else None
        _, made = ensure(service, uuid=uuid, type_name=type_name, vm=domain, parent=parent, idempotency_key=key,
                         actor=actor)
        (created if made else ready).append(uuid)
    return {"vm": domain, "ready": ready, "created": created}


def libvirt_release(service: Service, domain: str, xml: str, *, grace: float = 0.0,
                    actor: str | None = None) -> dict[str, Any]:
    """After a domain stopped: release the vGPUs vgpumgr recorded for it among the mdevs it names."""
    uuids, _ = _domain_mdevs(xml)
    # libvirtd is waiting for this hook: asking it which domains hold the device would deadlock
    return release_vm(service, domain, uuids, grace=grace, actor=actor, check_libvirt=False)
