"""VMs around their vGPUs: create (allocate, render, validate, define, start, or undo it all), delete,
power, attach and detach."""

from __future__ import annotations

from typing import Any

from vgpumgr import ids
from vgpumgr.audit import chain as audit
from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.backends import nvidia_vf
from vgpumgr.db import store
from vgpumgr.errors import Conflict, InvalidInput, NotFound, VgpuError
from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF
from vgpumgr.ops import allocate as alloc
from vgpumgr.ops import leases
from vgpumgr.ops import mig as mig_ops
from vgpumgr.ops import scheduler as scheduler_ops
from vgpumgr.ops.context import FAILED, Context, suppress
from vgpumgr.ops.records import hostdev_for, is_nvidia, metadata_for
from vgpumgr.placement.placer import Policy


def create_vm(svc: Context, name: str, *, vgpus: list[str] | None = None, passthrough: list[str] | None = None,
              mig: list[str] | None = None, memory_mib: int = 4096, vcpus: int = 2, disk: str | None = None,
              network: str | None = None, firmware: str = "bios", display: bool = False,
              policy: Policy | None = None, start: bool = False, print_xml: bool = False,
              idempotency_key: str | None = None, actor: str | None = None,
              licence_delivery: str | None = None) -> dict[str, Any]:
    """Place and create the VM's GPU devices, render and validate its XML, define (and start) it.

    Any failure undoes what was done, in reverse order, and is audited. `print_xml` changes nothing."""
    from vgpumgr.ops import licence_delivery as delivery
    from vgpumgr.virt.domain import VmSpec, render

    name = ids.vm_name(name)
    if licence_delivery is not None:
        delivery.check_mode(licence_delivery)
    vgpus, mig = list(vgpus or []), list(mig or [])
    asked, passthrough = list(passthrough or []), []
    for a in asked:  # a model name ("Ascend 910B"): the lowest free card of it not asked for already
        passthrough.append(ids.pci_address(a) if ids.is_pci_address(a) else
                           whole_device(svc, a, exclude=[*passthrough, *(x for x in asked if ids.is_pci_address(x))]))
    if not (vgpus or passthrough or mig):
        raise InvalidInput("a VM needs at least one GPU device",
                           hint="give --vgpu TYPE, --passthrough BDF or --mig PROFILE")
    vm_uuid = ids.new_uuid()
    spec = VmSpec(name=name, uuid=vm_uuid, memory_mib=memory_mib, vcpus=vcpus, firmware=firmware, disk=disk,
                  network=network, domain_type=svc.cfg.domain_type)
    render(spec)  # bad memory, disk path or network is refused before anything is allocated
    if print_xml:
        spec.hostdevs = _dry_run_hostdevs(svc, name, vgpus, passthrough, mig, policy, display)
        return {"name": name, "uuid": vm_uuid, "state": "not defined", "xml": render(spec), "allocations": []}
    virt = svc.virt()
    if virt.exists(name):
        raise Conflict(f"a VM named {name} already exists", hint="choose another name or delete it first")
    made: list[dict[str, Any]] = []
    defined = started = False
    try:
        key = idempotency_key
        # The allocations stay owned by this process until the domain is defined: if it dies in between,
        # the next lock holder, the service start or `reconcile --fix` rolls them back.
        with leases.holding():
            for i, t in enumerate(vgpus):
                made.append(alloc.allocate(svc, t, vm=name, policy=policy, actor=actor,
                                           idempotency_key=f"{key}/vgpu/{i}" if key else None))
            for i, profile in enumerate(mig):
                made.append(mig_ops.allocate_mig(svc, profile, vm=name, policy=policy, actor=actor,
                                                 idempotency_key=f"{key}/mig/{i}" if key else None))
            for i, addr in enumerate(passthrough):
                made.append(alloc.allocate_passthrough(svc, addr, vm=name, actor=actor,
                                                       idempotency_key=f"{key}/pt/{i}" if key else None))
        spec.hostdevs = [hostdev_for(a, display and i == 0) for i, a in enumerate(made)]
        spec.allocations = [metadata_for(a) for a in made]
        if licence_delivery is not None:
            delivery.set_vm_mode(svc, name, licence_delivery, actor=actor, vm_uuid=vm_uuid)
        spec.fwcfg = delivery.fwcfg_for(svc, name, vm_uuid, made, started=start)
        xml = render(spec)
        leases.crash_point("allocated")
        virt.define(xml)
        defined = True
        leases.crash_point("defined")
        if start:
            virt.start(name)
            started = True
            svc.host.kernel.vm_started(name, xml)
        with svc.tx() as s:
            store.upsert_vm(s, svc.host_id(s), name, uuid=vm_uuid, state="running" if started else "defined")
            leases.release_hold(svc, s, [a["id"] for a in made])
            svc.event(s, audit.VM_DEFINE, actor=actor, vm=name,
                       detail={"uuid": vm_uuid, "devices": [a.get("uuid") or a.get("pci_address") for a in made]})
            if started:
                svc.event(s, audit.VM_START, actor=actor, vm=name)
    except BaseException as e:
        _undo_vm(svc, virt, name, made, defined, started, e, actor)
        raise
    return {"name": name, "uuid": vm_uuid, "state": "running" if started else "defined", "allocations": made}

def whole_device(svc: Context, model: str, exclude: list[str] | None = None) -> str:
    """A free card of `model` to pass through whole (placement/whole.py); `exclude`: addresses already asked for."""
    from vgpumgr.placement.whole import pick

    if not model or len(model) > 64:
        raise InvalidInput(f"'{model}' is neither a PCI address nor a model", hint="give 0000:83:00.0 or a model name")
    busy = {a["gpu"] or a["parent"] for a in alloc.allocations(svc, live=True)}
    busy |= {ids.pci_address(a) for a in exclude or []}
    address, _ = pick(svc.snapshot(refresh=True).inventory, busy, model)
    return address


def _undo_vm(svc: Context, virt, name: str, made: list[dict[str, Any]], defined: bool, started: bool,  # noqa: ANN001
             error: BaseException, actor: str | None) -> None:
    undone = []
    if started:
        with suppress():
            svc.host.kernel.vm_stopping(virt.xml(name))
            virt.stop(name)
            undone.append("stopped")
    if defined:
        with suppress():
            virt.undefine(name)
            undone.append("undefined")
    for a in reversed(made):
        with suppress():
            alloc.release(svc, a.get("uuid") or a["pci_address"], actor=actor)
            undone.append(f"released {a.get('uuid') or a.get('pci_address')}")
    with suppress():
        from vgpumgr.ops import licence_delivery

        licence_delivery.forget_vm(svc, name, None)
    with svc.tx() as s:
        h = svc.host_id(s)
        vm_row = store.get_vm(s, h, name)
        if vm_row is not None and not store.allocations(s, h, vm=vm_row, live=True):
            vm_row.state = "deleted"
        svc.event(s, "vm.create", FAILED, actor=actor, vm=name, error=str(error), detail={"rolled_back": undone})

def _dry_run_hostdevs(svc: Context, name: str, vgpus: list[str], passthrough: list[str], mig: list[str],
                      policy: Policy | None, display: bool) -> list[Any]:
    from vgpumgr.virt.dryrun import plan_hostdevs

    snap = svc.snapshot()
    with svc.sessions() as s:
        records = alloc.live_records(svc, s)
    return plan_hostdevs(snap.inventory, snap.placer, records, name, vgpus, passthrough, mig, policy, display)

def delete_vm(svc: Context, name: str, *, actor: str | None = None) -> dict[str, Any]:
    """Stop and undefine the VM, then release its vGPUs and licence seats."""
    name = ids.vm_name(name)
    virt = svc.virt()
    exists = virt.exists(name)
    if exists:
        # Owned by this process from here to their release: if it dies after the undefine, the vGPUs of a
        # VM that no longer exists are rolled back instead of leaking.
        with svc.locked():
            leases.take(svc, [a["id"] for a in alloc.allocations(svc, vm=name, live=True)])
    was_running = exists and virt.state(name) in ("running", "paused")
    if was_running:
        svc.host.kernel.vm_stopping(virt.xml(name))
        virt.stop(name)
    dom_uuid = None
    if exists:
        from vgpumgr.virt.domain import parse_xml

        dom_uuid = parse_xml(virt.xml(name, inactive=True)).findtext("uuid")
        virt.undefine(name)
        leases.crash_point("undefined")
    released = []
    for a in alloc.allocations(svc, vm=name, live=True):
        ref = a["uuid"] or a["pci_address"]
        alloc.release(svc, ref, actor=actor, grace=svc.teardown_grace if was_running and is_nvidia(a) else 0.0)
        released.append(ref)
    with svc.tx() as s:
        h = svc.host_id(s)
        vm_row = store.get_vm(s, h, name)
        if vm_row is None and not exists:
            raise NotFound(f"no VM {name}", hint="`vgpumgr vm list` shows the VMs")
        if vm_row is not None:
            vm_row.state = "deleted"
        if was_running:
            svc.event(s, audit.VM_STOP, actor=actor, vm=name)
        svc.event(s, audit.VM_UNDEFINE, actor=actor, vm=name, detail={"released": released})
    from vgpumgr.ops import licence_delivery

    licence_delivery.forget_vm(svc, name, dom_uuid)
    if was_running or released:
        scheduler_ops.apply_pending(svc.cfg, actor=actor)  # a GPU it emptied takes its recorded scheduler now
    return {"name": name, "state": "deleted", "released": released}

def start_vm(svc: Context, name: str, *, actor: str | None = None) -> dict[str, Any]:
    from vgpumgr.ops import licence_delivery

    name = ids.vm_name(name)
    _ensure_devices(svc, name, actor)
    if svc.virt().exists(name):  # what the libvirt prepare hook does, for hosts without it
        licence_delivery.prepare_start(svc, name, svc.virt().xml(name, inactive=True))

    def start(v: Any) -> None:
        v.start(name)
        svc.host.kernel.vm_started(name, v.xml(name))

    return _power(svc, name, audit.VM_START, "running", start, actor)

def stop_vm(svc: Context, name: str, *, actor: str | None = None, force: bool = True) -> dict[str, Any]:
    name = ids.vm_name(name)
    def stop(v: Any) -> None:
        svc.host.kernel.vm_stopping(v.xml(name))
        v.stop(name, force=force)

    res = _power(svc, name, audit.VM_STOP, "shut off", stop, actor)
    scheduler_ops.apply_pending(svc.cfg, actor=actor)  # a GPU it emptied takes its recorded scheduler now
    return res

def _power(svc: Context, name: str, action: str, state: str, op: Any, actor: str | None) -> dict[str, Any]:
    try:
        op(svc.virt())
    except VgpuError as e:
        svc.record_failure(action, e, actor=actor, vm=name)
        raise
    with svc.tx() as s:
        store.upsert_vm(s, svc.host_id(s), name, state=state)
        svc.event(s, action, actor=actor, vm=name)
    return vm(svc, name)

def _ensure_devices(svc: Context, name: str, actor: str | None) -> list[str]:
    """Re-create a VM's recorded vGPUs that vanished (after a reboot or driver reload) before a start."""
    from vgpumgr.ops import vgpu_mode
    from vgpumgr.ops.reconcile import remake

    restored: list[str] = []
    lost_mode: set[str] | None = None
    for a in alloc.allocations(svc, vm=name, live=True):
        gone = ((a["backend"] == BACKEND_MDEV and mdev_backend.get(svc.host, a["uuid"]) is None)
                or (a["backend"] == BACKEND_NVIDIA_VF and (not svc.host.pci(a["pci_address"]).exists()
                                                           or nvidia_vf.current(svc.host, a["pci_address"]) == 0)))
        if gone:
            if lost_mode is None:
                lost_mode = {d["gpu"] for d in vgpu_mode.drift(svc, svc.snapshot().inventory)}
            restored.append(remake(svc, a, actor, lost_mode))
    if restored:
        svc.invalidate()
        with svc.tx() as s:
            svc.event(s, audit.RECONCILE, actor=actor, vm=name, detail={"restored": restored})
    return restored

def list_vms(svc: Context) -> list[dict[str, Any]]:
    virt = svc.virt()
    live = {a["vm"]: [] for a in alloc.allocations(svc, live=True) if a["vm"]}
    for a in alloc.allocations(svc, live=True):
        if a["vm"]:
            live[a["vm"]].append(a.get("uuid") or a.get("pci_address"))
    out = []
    for d in virt.list():
        out.append({**d, "vgpus": live.get(d["name"], [])})
    return sorted(out, key=lambda d: d["name"])

def vm(svc: Context, name: str) -> dict[str, Any]:
    from vgpumgr.virt.domain import read_allocations

    name = ids.vm_name(name)
    virt = svc.virt()
    if not virt.exists(name):
        raise NotFound(f"no VM {name}", hint="`vgpumgr vm list` shows the VMs")
    d = next(x for x in virt.list() if x["name"] == name)
    return {**d, "allocations": alloc.allocations(svc, vm=name, live=True),
            "metadata": read_allocations(virt.xml(name))}

def vm_xml(svc: Context, name: str) -> str:
    name = ids.vm_name(name)
    virt = svc.virt()
    if not virt.exists(name):
        raise NotFound(f"no VM {name}", hint="`vgpumgr vm list` shows the VMs")
    return virt.xml(name)

def attach_vgpu(svc: Context, name: str, type_name: str, *, actor: str | None = None) -> dict[str, Any]:
    from vgpumgr.virt.domain import hostdev_xml

    name = ids.vm_name(name)
    virt = svc.virt()
    if not virt.exists(name):
        raise NotFound(f"no VM {name}", hint="`vgpumgr vm list` shows the VMs")
    a = alloc.allocate(svc, type_name, vm=name, actor=actor)
    try:
        virt.attach(name, hostdev_xml(hostdev_for(a, False)))
    except BaseException:
        alloc.release(svc, a.get("uuid") or a["pci_address"], actor=actor)
        raise
    return a

def detach_vgpu(svc: Context, name: str, ref: str, *, actor: str | None = None) -> dict[str, Any]:
    from vgpumgr.virt.domain import hostdev_xml

    name = ids.vm_name(name)
    a = alloc.find_allocation(svc, ref)
    if a["vm"] != name:
        raise Conflict(f"{ref} does not belong to VM {name}", hint="`vgpumgr vm show NAME` lists its vGPUs")
    svc.virt().detach(name, hostdev_xml(hostdev_for(a, False)))
    return alloc.release(svc, ref, actor=actor)

