"""What the host-side hooks ask for, composed from Service calls: ensure a vGPU exists, release a VM's vGPUs.

Hooks are retried and re-run (every VM start, after a host reboot), so each operation is idempotent by the
mdev UUID or the VF address: a live record whose device exists is returned as it is; a live mdev record whose
device vanished (host reboot) is created again with the same UUID on the same parent; a recorded VF that lost
its `current_vgpu_type` gets it written again. Every release names its owner (VM and allocation id), so a
late release never clears a vGPU the device's next VM got since.
"""

from __future__ import annotations

from typing import Any

from vgpumgr import ids
from vgpumgr.errors import Conflict, InvalidInput, NoCapacity, NotFound, VgpuError
from vgpumgr.model import BACKEND_NVIDIA_VF
from vgpumgr.ops import adopt as adopt_ops
from vgpumgr.ops import allocate as alloc
from vgpumgr.ops import incoming as incoming_ops
from vgpumgr.ops import scheduler as scheduler_ops
from vgpumgr.ops import stale as stale_ops
from vgpumgr.ops.allocate import KERNEL_OWNER_PROXMOX, Owner
from vgpumgr.ops.context import Context
from vgpumgr.placement.placer import Policy


def _live(svc: Context, uuid: str) -> dict[str, Any] | None:
    try:
        return alloc.find_allocation(svc, uuid)
    except NotFound:
        return None


def _present(svc: Context, uuid: str) -> bool:
    return svc.host.mdev(uuid).exists()  # /sys/bus/mdev/devices/<uuid>: the kernel's own answer


def ensure(svc: Context, *, uuid: str, type_name: str, vm: str, parent: str | None = None,
           idempotency_key: str | None = None, actor: str | None = None) -> tuple[dict[str, Any], bool]:
    """(allocation, created) for the mdev `uuid` of `vm`."""
    uuid, vm = ids.mdev_uuid(uuid), ids.vm_name(vm)
    parent = ids.parent_name(parent) if parent else None
    rec = _live(svc, uuid)
    if rec is not None:
        if rec["vm"] != vm:
            raise Conflict(f"vGPU {uuid} belongs to VM {rec['vm']}, not {vm}",
                           hint="release it from that VM first (`vgpumgr vgpu remove`)", vm=rec["vm"])
        if _present(svc, uuid):
            return rec, False
        # The record outlived its device (host reboot): create it again where it was.
        parent = parent or rec["parent"]
        type_name = type_name or rec["type"]
        alloc.release(svc, uuid, actor=actor)
    elif _present(svc, uuid):
        raise Conflict(f"mdev {uuid} exists but vgpumgr has no record of it",
                       hint="`vgpumgr reconcile` lists unknown devices; remove it or let vgpumgr adopt it", uuid=uuid)
    policy = Policy(pin_parent=parent) if parent else None
    from vgpumgr.ops.restore_vendor import ensure_vnpu_mode

    ensure_vnpu_mode(svc, parent, type_name, actor)  # an Ascend vNPU needs the card's VM mode (lost at reboot)

    def allocate() -> dict[str, Any]:
        return alloc.allocate(svc, type_name, vm=vm, uuid=uuid, policy=policy, idempotency_key=idempotency_key,
                              actor=actor)

    try:
        try:
            return allocate(), True
        except NoCapacity:
            # a legacy Proxmox card's lost post-stop may be what fills the GPU: its record goes, then try again
            if not (stale_ops.PVE_VM.match(vm) and stale_ops.release_stale_mdevs(svc, actor=actor)):
                raise
            return allocate(), True
    except Conflict:
        rec = _live(svc, uuid)  # a concurrent retry of the same request won the race
        if rec is not None and rec["vm"] == vm:
            return rec, False
        raise


def _ref(ref: str) -> str:
    return ids.pci_address(ref) if ids.is_pci_address(ref) else ids.mdev_uuid(ref)


def release_vm(svc: Context, vm: str, refs: list[str] | None = None, *, grace: float = 0.0,
               actor: str | None = None, check_libvirt: bool = True) -> dict[str, Any]:
    """Release the live vGPUs of `vm` (only those whose UUID or PCI address is in `refs` when given).

    Each release names its owner (the VM and the record's id): a record that changed hands between the
    listing and the release is left alone and reported under `refused`. Other errors are collected."""
    vm = ids.vm_name(vm)
    wanted = {_ref(r) for r in refs} if refs is not None else None
    released, refused, errors = [], [], []
    for a in alloc.allocations(svc, vm=vm, live=True):
        ref = a.get("uuid") or a.get("pci_address")
        if wanted is not None and ref not in wanted:
            continue
        try:
            alloc.release(svc, ref, actor=actor, grace=grace, check_libvirt=check_libvirt,
                            owner=Owner(vm, allocation_id=a["id"]))
            released.append(ref)
        except NotFound:
            continue  # released meanwhile
        except Conflict as e:
            (refused if "holder" in e.detail else errors).append({"vgpu": ref, "error": e.message, "hint": e.hint})
        except VgpuError as e:
            errors.append({"vgpu": ref, "error": e.message, "hint": e.hint})
    return {"vm": vm, "released": released, "refused": refused, "errors": errors}


def _domain_devices(xml: str) -> tuple[list[str], list[str], dict[str, dict[str, Any]]]:
    """(mdev UUIDs, unmanaged PCI hostdev addresses, vgpumgr metadata by UUID or address) of a domain."""
    from vgpumgr.virt.domain import _pci_from_attrs, parse_xml, read_allocations, referenced_devices

    try:
        uuids = referenced_devices(xml)["mdev"]
        vfs = []
        for hd in parse_xml(xml).iterfind("devices/hostdev[@type='pci']"):
            if hd.get("managed", "no") == "no":  # libvirt's default; NVIDIA VF vGPUs must be unmanaged
                try:
                    vfs.append(_pci_from_attrs(hd.find("source/address")))
                except (InvalidInput, ValueError):
                    continue
        meta = {}
        for r in read_allocations(xml):
            key = r.get("uuid") or r.get("pci_address")
            if isinstance(key, str):
                meta[key] = r
    except VgpuError:
        raise
    except Exception as exc:  # lxml parse errors and the like: the caller sent something that is not a domain
        raise InvalidInput(f"the domain XML cannot be read: {exc}", hint="pass the XML libvirt gives the hook") from exc
    return uuids, list(dict.fromkeys(vfs)), meta


def _prepare_vf(svc: Context, domain: str, address: str, meta: dict[str, Any], key: str | None,
                actor: str | None) -> str | None:
    """'ready', 'restored' or 'created' for one unmanaged PCI hostdev; None when vgpumgr has no say in it."""
    rec = _live(svc, address)
    type_name = meta.get("type") if meta.get("backend", BACKEND_NVIDIA_VF) == BACKEND_NVIDIA_VF else None
    if rec is not None:
        if rec["backend"] != BACKEND_NVIDIA_VF:
            return None  # a passthrough record: libvirt's business
        _, written = adopt_ops.reapply_vf_type(svc, address, vm=domain, actor=actor)
        return "restored" if written else "ready"
    if not type_name:
        return None  # plain passthrough, or a VF someone else prepares
    held = next((v for v in svc.snapshot(refresh=True).inventory.vf_vgpus if v.address == address), None)
    if held is not None and held.type == ids.type_dir(type_name):
        adopt_ops.adopt(svc, backend=BACKEND_NVIDIA_VF, pci_address=address, type_id=type_name, vm=domain,
                      source="libvirt-metadata", actor=actor)
        return "ready"
    alloc.allocate(svc, type_name, vm=domain, policy=Policy(pin_parent=address), idempotency_key=key, actor=actor)
    return "created"


def libvirt_prepare(svc: Context, domain: str, xml: str, *, actor: str | None = None,
                    key_prefix: str | None = None) -> dict[str, Any]:
    """Before a domain starts: each mdev it names must exist (re-created from records or its metadata), and
    each unmanaged PCI hostdev that is a recorded VF vGPU (or whose metadata names a type) must hold it."""
    domain = ids.vm_name(domain)
    uuids, vfs, meta = _domain_devices(xml)
    present = {m.uuid for m in svc.snapshot(refresh=True).inventory.mdevs} if uuids else set()
    ready, created, restored = [], [], []
    for n, uuid in enumerate(uuids):
        rec = _live(svc, uuid)
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
        _, made = ensure(svc, uuid=uuid, type_name=type_name, vm=domain, parent=parent, idempotency_key=key,
                         actor=actor)
        (created if made else ready).append(uuid)
    for n, address in enumerate(vfs):
        key = f"{key_prefix}-vf{n}" if key_prefix else None
        outcome = _prepare_vf(svc, domain, address, meta.get(address, {}), key, actor)
        {"ready": ready, "created": created, "restored": restored}.get(outcome or "", []).append(address)
    arrived = incoming_ops.arrived(svc, domain, actor=actor)  # a migrating domain's vGPUs become active here
    stale_ops.note_domain(svc, domain, xml)  # libvirt has it: once it is gone, its records can be judged stale
    from vgpumgr.ops import licence_delivery

    licence = licence_delivery.prepare_start(svc, domain, xml)  # the fw_cfg token copy QEMU is about to read
    svc.host.kernel.vm_started(domain, xml)  # a simulated host: QEMU opens the vGPUs next
    return {"vm": domain, "ready": ready, "created": created, "restored": restored, "arrived": arrived,
            **({"licence": licence} if licence else {})}


def libvirt_migrate(svc: Context, domain: str, xml: str, *, actor: str | None = None) -> dict[str, Any]:
    """`migrate begin` / `restore begin` on this host: reserve the incoming domain's vGPUs here and hand back
    its XML rewritten to them (see ops/incoming.py)."""
    return incoming_ops.receive(svc, domain, xml, actor=actor)


def libvirt_release(svc: Context, domain: str, xml: str, *, grace: float = 0.0,
                    actor: str | None = None) -> dict[str, Any]:
    """After a domain stopped: release the vGPUs vgpumgr recorded for it among the devices it names."""
    uuids, vfs, _ = _domain_devices(xml)
    svc.host.kernel.vm_stopping(xml)  # a simulated host: QEMU has let the vGPUs go
    # libvirtd is waiting for this hook: asking it which domains hold the device would deadlock
    res = release_vm(svc, domain, uuids + vfs, grace=grace, actor=actor, check_libvirt=False)
    scheduler_ops.apply_pending(svc.cfg, actor=actor)  # a GPU it emptied takes its recorded scheduler now
    return res


# -- Proxmox on NVIDIA's vendor-specific VFIO framework: Proxmox writes the type, vgpumgr keeps the books --
def proxmox_check(svc: Context, vm: str, type_name: str, candidates: list[str], *,
                  actor: str | None = None) -> dict[str, Any]:
    """Proxmox runs pre-start only for a VM that is not running: VF records it still has are stale (a host
    crash or reboot skipped post-stop) and would block its own VF, so they go first (records only). So do
    other VMs' records on the candidate VFs that the host shows stale (ops/stale.py: a post-stop lost or late)."""
    vm = ids.vm_name(vm)
    for a in alloc.allocations(svc, vm=vm, live=True):
        if a["backend"] == BACKEND_NVIDIA_VF:
            try:
                alloc.release(svc, a["pci_address"], actor=actor, owner=Owner(vm, allocation_id=a["id"]))
            except NotFound:
                pass
    released = stale_ops.release_stale_vfs(svc, candidates, actor=actor)
    result = adopt_ops.check_start(svc, type_name, vm=vm, candidates=candidates, actor=actor)
    from vgpumgr.ops import licence_delivery

    fwcfg = licence_delivery.proxmox_args(svc, vm)  # Proxmox gives fw_cfg to QEMU only through root's `args:`
    return {**result, "released_stale": [r for r in released if r["action"] == "released"],
            **({"licence_fwcfg_args": fwcfg} if fwcfg else {})}


def proxmox_record(svc: Context, vm: str, type_name: str, vf: str, *, actor: str | None = None
                   ) -> tuple[dict[str, Any], bool]:
    """Record the VF Proxmox gave `vm` (it reserved it for the VM, so an older record there is stale)."""
    return adopt_ops.adopt(svc, backend=BACKEND_NVIDIA_VF, pci_address=vf, type_id=type_name, vm=vm, supersede=True,
                         source="proxmox", detail={"kernel_owner": KERNEL_OWNER_PROXMOX}, actor=actor)
