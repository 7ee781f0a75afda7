"""Placing, creating and releasing one vGPU (mdev or VF vGPU type) or one whole GPU.

allocate: lock -> (one transaction: read live records, place, reserve, take a licence seat, audit) ->
kernel write -> (transaction: activate, audit); a failed kernel write releases the reservation and its seat.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from sqlalchemy.orm import Session

from vgpumgr import ids
from vgpumgr.audit import chain as audit
from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.backends import nvidia_vf, vendor_vf
from vgpumgr.db import store
from vgpumgr.db.models import Allocation as AllocRow
from vgpumgr.errors import Conflict, InvalidInput, NoCapacity, NotFound, VgpuError
from vgpumgr.licensing import seats as licensing
from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF, BACKEND_PASSTHROUGH, BACKEND_VF
from vgpumgr.ops import boot_records, leases, placement_apply
from vgpumgr.ops.context import FAILED, Context, suppress
from vgpumgr.ops.records import allocation_dict, placed
from vgpumgr.placement.placer import Allocation as PlacedAlloc
from vgpumgr.placement.placer import Decision, Policy, Request


def live_records(svc: Context, s: Session, rows: list[Any] | None = None) -> list[PlacedAlloc]:
    """The live vGPU allocations as placement sees them (one query, unless `rows` of `store.live_rows`)."""
    return placed(store.live_rows(s, svc.host_id(s)) if rows is None else rows)


def place(svc: Context, type_name: str, vm: str | None = None, policy: Policy | None = None,
          free_gpu_instances: dict[str, list[str]] | None = None) -> Decision:
    """What placement would choose now, changing nothing."""
    snap = svc.snapshot()
    with svc.reads() as s:
        records = live_records(svc, s)
    return snap.placer.place(records, Request(type_name, vm), policy or Policy(),
                             free_gpu_instances=free_gpu_instances)


def allocate(svc: Context, type_name: str, *, vm: str | None = None, policy: Policy | None = None,
             idempotency_key: str | None = None, uuid: str | None = None, actor: str | None = None,
             detail: dict[str, Any] | None = None, free_gpu_instances: dict[str, list[str]] | None = None,
             lease_id: int | None = None, activate: bool = True) -> dict[str, Any]:
    """Place and create one vGPU. A retried request with the same idempotency key gets the same vGPU.

    `lease_id`: a held licence seat the vGPU shares instead of taking one (a VM migrating in on a shared
    database keeps its seat). `activate=False`: the device is made but the record stays *reserved*, owned by
    this process, until the caller activates it (an incoming migration: when the domain starts here)."""
    uuid = ids.mdev_uuid(uuid) if uuid else None
    vm = ids.vm_name(vm) if vm else None
    policy = policy or Policy()
    args = (svc, type_name, vm, policy, idempotency_key, uuid, actor, detail, free_gpu_instances, lease_id)
    with svc.locked():  # held from the decision to the kernel write: the reservation row guards the rest
        try:
            made = _allocate_locked(*args, check_dead=True)
        except leases.ReapFirst:  # a crashed process left reservations behind: roll them back, then go on
            leases.reap(svc, actor)
            made = _allocate_locked(*args, check_dead=False)
    if isinstance(made, dict):
        return made  # the earlier answer to this idempotency key
    row, c = made
    if not activate:
        with svc.reads() as s:
            return allocation_dict(row, s, vm_name=vm)
    # Our reserved row (owned by this live process) counts as taken for every other placement meanwhile.
    with svc.tx() as s:  # `row` is what the reservation wrote (and its seat): no need to read it back
        store.activate(s, row, keep_owner=leases.is_holding())
        if c.gpu and c.parent != c.gpu and ids.is_pci_address(c.parent):  # on a VF: remember its PF's VFs
            boot_records.remember_vfs_of(s, svc.host_id(s), svc.host, c.gpu)
        # and every other NVIDIA GPU's enabled VFs, vGPUs on them or not: a reboot must give back what was offered
        boot_records.remember_enabled_vfs(s, svc.host_id(s), svc.snapshot().inventory.gpus)
        if c.gpu and (c.backend == BACKEND_VF or c.type.startswith("vnpu-")):  # a vendor card's mode steps
            from vgpumgr.vendors.steps import observed, to_record

            boot_records.remember_vendor(s, svc.host_id(s), c.gpu, to_record(observed(svc.host, c.gpu)))
        svc.event(s, audit.VGPU_CREATE, actor=actor, gpu=c.gpu, vm=vm, vgpu=row.uuid or row.pci_address,
                   detail={"type": c.type, "name": c.name, "parent": c.parent, "backend": c.backend})
        return allocation_dict(row, s, vm_name=vm)


def _allocate_locked(svc: Context, type_name: str, vm: str | None, policy: Policy, idempotency_key: str | None,
                     uuid: str | None, actor: str | None, detail: dict[str, Any] | None,
                     free_gpu_instances: dict[str, list[str]] | None, lease_id: int | None, *, check_dead: bool
                     ) -> dict[str, Any] | tuple[AllocRow, Any]:
    """Decide, reserve and write to the kernel (holding the host lock): the reserved row and the choice, or
    the earlier answer to the idempotency key."""
    with svc.tx() as s:  # one transaction: dead owners?, the key, the records, place, reserve, seat, audit
        live = store.live_rows(s, svc.host_id(s))  # one query for the dead-owner check and placement
        if check_dead:
            leases.check_dead(svc, live)
        if idempotency_key:
            found = _by_key(svc, s, idempotency_key)
            if found is not None:
                return found
        decision = _decide(svc, s, type_name, vm, policy, free_gpu_instances, live)
        c = decision.choice
        if c is None:
            err = NoCapacity(f"no GPU can take a {type_name} vGPU now: {decision.summary()}",
                             hint="`vgpumgr place --type ... --explain` shows why each candidate was refused",
                             rejected=[r.__dict__ for r in decision.rejected][:20])
            svc.event(s, audit.PLACEMENT, FAILED, actor=actor, vm=vm, error=str(err),
                       detail={"type": type_name, "policy": dataclasses.asdict(policy)})
        else:
            inv = svc.snapshot().inventory
            t = next((t for t in inv.types_of(c.parent) if t.type == c.type), None)
            parsed = ids.parse_type_name(c.name or "")
            fb = t.framebuffer_mb if t and t.framebuffer_mb else (
                int(parsed.framebuffer_gb * 1024) if parsed else None)
            series = t.series if t and t.series else (parsed.series if parsed else None)
            new_uuid = (uuid or ids.new_uuid()) if c.backend == BACKEND_MDEV else None
            g = inv.gpu(c.gpu) if c.gpu else None
            h = svc.host_id(s)
            gpu_row = svc.gpu_row(s, c.gpu, g.name if g else "") if c.gpu else None
            vm_row = store.vm_ref(s, h, vm) if vm else None
            row = store.reserve_allocation(
                s, h, backend=c.backend, parent=c.parent, type_id=c.type, uuid=new_uuid,
                pci_address=c.parent if c.backend in (BACKEND_NVIDIA_VF, BACKEND_VF) else None, gpu=gpu_row, vm=vm_row,
                type_name=c.name, series=series, idempotency_key=idempotency_key,
                detail={"framebuffer_mb": fb, "gpu": c.gpu, **_mig_detail(parsed), **(detail or {}),
                        **({"placement_id": c.placement_id} if c.placement_id is not None else {})},
                owner=leases.owner_values(svc))
            if lease_id is None or not licensing.share(s, row, lease_id):
                licensing.acquire(s, vm_row, gpu_row, series, svc.licence_mode, allocation=row,
                                  actor=actor or svc.cfg.actor, host_name=svc.hostname)
            svc.event(s, audit.PLACEMENT, actor=actor, gpu=c.gpu, vm=vm, vgpu=new_uuid or c.parent,
                       detail={"type": c.type, "name": c.name, "parent": c.parent, "why": c.why})
    if c is None:
        raise err
    leases.crash_point("reserved")
    made = False
    try:
        if c.backend == BACKEND_MDEV:
            mdev_backend.create(svc.host, c.parent, c.type, new_uuid)
        elif c.backend == BACKEND_VF:
            vendor_vf.claim(svc.host, c.parent)  # nothing to write: libvirt hands the whole VF over (managed)
        else:
            nvidia_vf.set_type(svc.host, c.parent, c.type)
        made = c.backend in (BACKEND_MDEV, BACKEND_NVIDIA_VF)
        if c.placement_id is not None:
            placement_apply.give(svc, row.id, c, new_uuid)
        elif made:  # equal size on Ada+/R570+: the driver's own choice
            placement_apply.observe(svc, row, c, new_uuid)
    except BaseException as e:
        if made:  # nothing half-made: the vGPU goes with a refused placement or a record that could not be written
            with suppress():
                if c.backend == BACKEND_MDEV:
                    mdev_backend.remove(svc.host, new_uuid)
                else:
                    nvidia_vf.clear_type(svc.host, c.parent, retries=1)
        _rollback_allocation(svc, row.id, e, actor)
        svc.invalidate()
        raise
    svc.touch(c.gpu, c.parent)
    leases.crash_point("created")
    return row, c



def _mig_detail(parsed: ids.TypeName | None) -> dict[str, str]:
    """A MIG-backed type's GPU-instance profile, recorded however the vGPU was asked for (`vgpu --type
    A100D-1-10C` on a free instance as `vm create --mig 1g.10gb`): the free instances are counted by it."""
    return {"mig_profile": parsed.mig_profile} if parsed is not None and parsed.mig_profile else {}


def _decide(svc: Context, s: Session, type_name: str, vm: str | None, policy: Policy,
            free_gpu_instances: dict[str, list[str]] | None = None, live: list[Any] | None = None) -> Decision:
    records = live_records(svc, s, live)
    req = Request(type_name, vm)
    decision = svc.snapshot().placer.place(records, req, policy, free_gpu_instances=free_gpu_instances)
    if decision.choice is None and time.monotonic() - svc.snapshot().taken > 0.05:
        decision = svc.snapshot(refresh=True).placer.place(records, req, policy,
                                                            free_gpu_instances=free_gpu_instances)
    return decision


def by_key(svc: Context, key: str) -> dict[str, Any] | None:
    with svc.reads() as s:
        return _by_key(svc, s, key)


def _by_key(svc: Context, s: Session, key: str) -> dict[str, Any] | None:
    row = store.find_by_idempotency_key(s, svc.host_id(s), key)
    if row is None:
        return None
    if row.state == "released":
        raise Conflict(f"idempotency key '{key}' belongs to a released vGPU", hint="use a new key for a new request")
    return allocation_dict(row, s)

def _rollback_allocation(svc: Context, row_id: int, error: BaseException, actor: str | None) -> None:
    with svc.tx() as s:
        row = s.get(AllocRow, row_id)
        store.release(s, row)
        store.forget_idempotency_key(s, row_id)  # the request did not happen: its retry may allocate
        svc.event(s, audit.VGPU_CREATE, FAILED, actor=actor, gpu=(row.detail or {}).get("gpu"),
                   vm=allocation_dict(row, s)["vm"], vgpu=row.uuid or row.pci_address, error=str(error),
                   detail={"type": row.type_id, "parent": row.parent, "rolled_back": True})


def allocate_passthrough(svc: Context, address: str, *, vm: str | None = None, idempotency_key: str | None = None,
                         actor: str | None = None) -> dict[str, Any]:
    """Record a whole GPU for a VM (libvirt's managed='yes' moves it to vfio-pci at VM start)."""
    address = ids.pci_address(address)
    vm = ids.vm_name(vm) if vm else None
    with svc.locked():
        leases.reap(svc, actor)
        if idempotency_key:
            found = by_key(svc, idempotency_key)
            if found is not None:
                return found
        g = svc.snapshot(refresh=True).inventory.gpu(address)
        if g is None:
            raise NotFound(f"no GPU {address}", hint="`vgpumgr gpus` lists the GPUs")
        if "passthrough" not in g.backends:
            raise InvalidInput(f"{address} cannot be passed through",
                               hint="it needs an IOMMU group and must be a physical function")
        busy = [m for m in svc.snapshot().inventory.mdevs if m.gpu == address] + \
            [v for v in svc.snapshot().inventory.vf_vgpus if v.gpu == address]
        if busy:
            raise Conflict(f"{address} hosts vGPUs", hint="remove its vGPUs before passing the whole GPU through")
        with svc.tx() as s:
            h = svc.host_id(s)
            if store.allocations(s, h, live=True, gpu=address):
                raise Conflict(f"{address} already has vGPUs or a passthrough allocation",
                               hint="release them first")
            gpu_row = store.upsert_gpu(s, h, address, model=g.name, vendor_id=g.vendor_id, device_id=g.device_id)
            vm_row = store.upsert_vm(s, h, vm) if vm else None
            # NVIDIA licenses passthrough GPUs (vApps/vCS/vWS); other vendors' cards need no NVIDIA seat
            series = licensing.PASSTHROUGH if g.vendor_id == "10de" else None
            row = store.reserve_allocation(s, h, backend=BACKEND_PASSTHROUGH, parent=address,
                                           type_id=store.PASSTHROUGH_TYPE, pci_address=address, gpu=gpu_row,
                                           vm=vm_row, type_name=g.name, series=series,
                                           idempotency_key=idempotency_key, detail={"gpu": address},
                                           owner=leases.owner_values(svc) if leases.is_holding() else None)
            licensing.acquire(s, vm_row, gpu_row, series, svc.licence_mode, allocation=row,
                              actor=actor or svc.cfg.actor, host_name=svc.hostname)
            store.activate(s, row, keep_owner=leases.is_holding())
            svc.event(s, audit.PLACEMENT, actor=actor, gpu=address, vm=vm, vgpu=address,
                       detail={"type": "passthrough", "name": g.name})
            return allocation_dict(row, s)

def find_allocation(svc: Context, ref: str) -> dict[str, Any]:
    """A live allocation by mdev UUID or PCI address."""
    with svc.reads() as s:
        row = _live_row(svc, s, ref)
        return allocation_dict(row, s)


def _live_core_row(svc: Context, s: Session, ref: str) -> Any:
    """The live allocation as a Core row (the release's lookup: no ORM object needed)."""
    return _live(svc, s, ref, store.live_allocation_row)


def _live_row(svc: Context, s: Session, ref: str) -> AllocRow:
    return _live(svc, s, ref, store.live_allocation)


def _live(svc: Context, s: Session, ref: str, lookup: Any) -> Any:
    h = svc.host_id(s)
    if ids.is_pci_address(ref):
        row = lookup(s, h, pci_address=ids.pci_address(ref))
    else:
        row = lookup(s, h, uuid=ids.mdev_uuid(ref))
    if row is None:
        raise NotFound(f"no live vGPU allocation {ref}", hint="`vgpumgr placements` lists them")
    return row

@dataclasses.dataclass(frozen=True)
class Owner:
    """Who a release is for: the VM and the allocation id or idempotency key it was given.

    A VF is reused across VMs, so a late or retried release must prove it still names the live record;
    otherwise it would clear the vGPU of the VM that got the device since."""

    vm: str
    allocation_id: int | None = None
    idempotency_key: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "vm", ids.vm_name(self.vm))
        if self.allocation_id is None and not self.idempotency_key:
            raise InvalidInput(f"a release for VM {self.vm} must name the allocation id or idempotency key it owns",
                               hint="pass the `id` or `idempotency_key` of the allocation being released")

    def matches(self, row: AllocRow, vm_name: str | None) -> bool:
        return (vm_name == self.vm
                and (self.allocation_id is None or row.id == self.allocation_id)
                and (not self.idempotency_key or row.idempotency_key == self.idempotency_key))

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


KERNEL_OWNER_PROXMOX = "proxmox"  # detail["kernel_owner"]: Proxmox writes and clears this VF's type itself


def release(svc: Context, ref: str, *, actor: str | None = None, grace: float = 0.0,
            check_libvirt: bool = True, owner: Owner | None = None) -> dict[str, Any]:
    """Destroy the device of a live allocation and release its record and licence seat.

    With `owner`, a record that no longer belongs to that owner is left alone (Conflict, audited); without,
    it is an administrator's release, audited as such."""
    with svc.locked():
        with svc.reads() as s:
            found = _live_core_row(svc, s, ref)
        row = store.detached(found)  # read once: the host lock keeps it ours until the release below
        row_id, backend = row.id, row.backend
        uuid, address = row.uuid, row.pci_address
        vm_name = found.vm_name
        gpu, parent = (row.detail or {}).get("gpu"), row.parent
        kernel_owner = (row.detail or {}).get("kernel_owner")
        stale = owner is not None and not owner.matches(row, vm_name)
        if stale:
            assert owner is not None
            err = Conflict(f"vGPU {uuid or address} now belongs to VM {vm_name or '(none)'} (allocation {row_id}),"
                           f" not to the release's owner {owner.as_dict()}: left in place",
                           hint="a late or repeated release of an earlier owner; nothing to do",
                           owner=owner.as_dict(), holder={"vm": vm_name, "allocation_id": row_id})
            svc.record_failure(audit.VGPU_REMOVE, err, actor=actor, vm=owner.vm, vgpu=uuid or address,
                               detail={"refused": "owner mismatch", "owner": owner.as_dict(),
                                       "holder": {"vm": vm_name, "allocation_id": row_id}})
            raise err
        # A running QEMU holds the device's VFIO group, which the backends see in /proc; libvirt is
        # asked as well only for a vGPU that belongs to a VM (its domain may run under another driver).
        # (check_libvirt=False from inside a libvirt hook: calling libvirtd back from there can deadlock)
        use_libvirt = bool(vm_name and check_libvirt)
        try:
            if backend == BACKEND_MDEV and uuid:
                mdev_backend.remove(svc.host, uuid, grace=grace,
                                    holder_check=svc.libvirt_holders("mdev") if use_libvirt else None)
            elif backend == BACKEND_VF and address:
                vendor_vf.check_free(svc.host, address,
                                     holder_check=svc.libvirt_holders("pci") if use_libvirt else None)
            elif backend == BACKEND_NVIDIA_VF and address and kernel_owner != KERNEL_OWNER_PROXMOX:
                nvidia_vf.clear_type(svc.host, address,
                                     holder_check=svc.libvirt_holders("pci") if use_libvirt else None,
                                     retries=10 if grace else 3, delay=1.0 if grace else 0.2)
        except VgpuError as e:
            svc.record_failure(audit.VGPU_REMOVE, e, actor=actor, vm=vm_name, vgpu=uuid or address)
            raise
        svc.touch(gpu, parent)
        if svc.fleet.wanted:  # the touched GPU re-read now, outside the release's transaction (placement reads it
            svc.snapshot()  # next anyway): the publish in it then only computes and writes, as after allocate
    # The device is gone; until this commits the live record keeps placement off it (never the reverse).
    with svc.tx() as s:
        if not store.release_live(s, row):  # a concurrent release of the same vGPU recorded it first
            raise NotFound(f"no live vGPU allocation {ref}", hint="it was released meanwhile")
        svc.event(s, audit.VGPU_REMOVE, actor=actor, gpu=gpu, vm=vm_name,
                   vgpu=uuid or address, detail={"type": row.type_id, "backend": backend,
                                                 "owner": owner.as_dict() if owner else "admin (none named)",
                                                 **({"kernel_owner": kernel_owner} if kernel_owner else {})})
        return allocation_dict(row, s, vm_name=vm_name)


def allocations(svc: Context, *, vm: str | None = None, gpu: str | None = None, state: str | None = None,
                live: bool | None = None) -> list[dict[str, Any]]:
    with svc.sessions() as s:
        return [allocation_dict(a, s) for a in store.allocations(s, svc.host_id(s), vm=vm, gpu=gpu, state=state,
                                                               live=live)]

