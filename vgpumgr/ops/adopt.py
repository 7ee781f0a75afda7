"""Recording a vGPU that something else made or will make: no kernel write.

Proxmox writes a VF's `current_vgpu_type` itself, so vgpumgr only records which VF it chose and takes the
licence seat; an mdevctl definition becomes a record so vgpumgr can restore it. The record is active at
once (adopting is the end of a creation that already happened elsewhere).
"""

from __future__ import annotations

from typing import Any

from vgpumgr import ids
from vgpumgr.audit import chain as audit
from vgpumgr.db import store
from vgpumgr.errors import Conflict, InvalidInput, NoCapacity, NotFound
from vgpumgr.licensing import seats as licensing
from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF
from vgpumgr.ops.allocate import _live_row
from vgpumgr.ops.context import Context
from vgpumgr.ops.records import allocation_dict
from vgpumgr.placement.placer import Policy


def _type_facts(svc: Context, backend: str, device: str, parent: str, type_id: str
                ) -> tuple[str | None, str | None, str | None, int | None]:
    """(gpu, name, series, framebuffer MiB) of `type_id` where it will live; a VF must already hold it."""
    inv = svc.snapshot(refresh=True).inventory
    if backend == BACKEND_NVIDIA_VF:
        vf = next((v for v in inv.vf_vgpus if v.address == device), None)
        if vf is None or vf.type != type_id:
            now = vf.type if vf else "no vGPU type"
            raise Conflict(f"VF {device} holds {now}, not {type_id}: nothing to record",
                           hint="record a VF only after its type was written (Proxmox does it after pre-start)")
        gpu, name = vf.gpu, vf.name
        known = next((t for t in inv.types if t.gpu == gpu and t.type == type_id), None)
    else:
        known = next((t for t in inv.types if t.parent == parent and t.type == type_id), None)
        gpu = known.gpu if known else next((m.gpu for m in inv.mdevs if m.parent == parent), None)
        if gpu is None and ids.is_pci_address(parent) and inv.gpu(parent) is not None:
            gpu = parent
        name = known.name if known else None
    parsed = ids.parse_type_name(name or "")
    series = (known.series if known else None) or (parsed.series if parsed else None)
    fb = (known.framebuffer_mb if known else None) or (int(parsed.framebuffer_gb * 1024) if parsed else None)
    return gpu, name, series, fb


def adopt(svc: Context, *, backend: str, type_id: str, vm: str | None = None, uuid: str | None = None,
          pci_address: str | None = None, parent: str | None = None, idempotency_key: str | None = None,
          supersede: bool = False, source: str, detail: dict[str, Any] | None = None,
          actor: str | None = None) -> tuple[dict[str, Any], bool]:
    """(record, adopted): record a vGPU made outside vgpumgr and take its licence seat.

    A live record of the same device and VM is returned as it is. A live record of another VM is a
    Conflict, unless `supersede` (the caller knows the device was handed on, e.g. Proxmox reserved it for
    this VM): then that record is released without touching the kernel, and audited."""
    type_id = ids.type_dir(type_id)
    vm = ids.vm_name(vm) if vm else None
    if backend == BACKEND_NVIDIA_VF:
        if not pci_address:
            raise InvalidInput("recording a VF vGPU needs the VF's PCI address")
        device = parent = ids.pci_address(pci_address)
    elif backend == BACKEND_MDEV:
        if not uuid or not parent:
            raise InvalidInput("recording an mdev needs its UUID and parent")
        device, parent = ids.mdev_uuid(uuid), ids.parent_name(parent)
    else:
        raise InvalidInput(f"cannot record a {backend} device", hint=f"use {BACKEND_MDEV} or {BACKEND_NVIDIA_VF}")
    with svc.locked():
        gpu, name, series, fb = _type_facts(svc, backend, device, parent, type_id)
        with svc.tx() as s:
            try:
                old = _live_row(svc, s, device)
            except NotFound:
                old = None
            if old is not None:
                old_vm = allocation_dict(old, s)["vm"]
                if old_vm == vm and old.type_id == type_id and old.parent == parent:
                    return allocation_dict(old, s), False
                if not supersede:
                    raise Conflict(f"{device} is already recorded for VM {old_vm or '(none)'} as {old.type_id}",
                                   hint="release that record first (`vgpumgr release`)", vm=old_vm)
                store.release(s, old)
                svc.event(s, audit.VGPU_REMOVE, actor=actor, gpu=gpu, vm=old_vm, vgpu=device,
                          detail={"superseded_by": vm, "source": source, "kernel": "untouched"})
            h = svc.host_id(s)
            gpu_row = svc.gpu_row(s, gpu, _model(svc, gpu)) if gpu else None
            vm_row = store.upsert_vm(s, h, vm) if vm else None
            row = store.reserve_allocation(
                s, h, backend=backend, parent=parent, type_id=type_id, type_name=name, series=series,
                uuid=device if backend == BACKEND_MDEV else None,
                pci_address=device if backend == BACKEND_NVIDIA_VF else None, gpu=gpu_row, vm=vm_row,
                idempotency_key=idempotency_key,
                detail={"framebuffer_mb": fb, "gpu": gpu, "adopted_from": source, **(detail or {})})
            licensing.acquire(s, vm_row, gpu_row, series, svc.licence_mode, allocation=row,
                              actor=actor or svc.cfg.actor, host_name=svc.hostname)
            store.activate(s, row)
            svc.event(s, audit.VGPU_CREATE, actor=actor, gpu=gpu, vm=vm, vgpu=device,
                      detail={"type": type_id, "name": name, "parent": parent, "backend": backend,
                              "adopted_from": source})
            result = allocation_dict(row, s)
        svc.touch(gpu, parent)
        return result, True


def _model(svc: Context, gpu: str) -> str:
    g = svc.snapshot().inventory.gpu(gpu)
    return g.name if g else ""


def check_start(svc: Context, type_name: str, *, vm: str, candidates: list[str], actor: str | None = None
                ) -> dict[str, Any]:
    """May `vm` get a `type_name` vGPU on one of the `candidates` VFs (tried in order, as Proxmox does)?

    Placement rules decide per VF; the licence seat is tried in a transaction that is rolled back. Changes
    nothing; raises NoCapacity (no VF passes) or NoSeat (enforce mode, no free seat) with the reasons."""
    vm = ids.vm_name(vm)
    vfs = [ids.pci_address(c) for c in candidates]
    if not vfs:
        raise InvalidInput("no candidate VF to check", hint="name the VF(s) from the VM's hostpci line")
    from vgpumgr.ops.allocate import place

    refused: list[str] = []
    svc.invalidate()  # Proxmox changed the VFs behind vgpumgr's back (its cleanup writes 0): read them afresh
    for vf in vfs:
        decision = place(svc, type_name, vm, Policy(pin_parent=vf))
        c = decision.choice
        if c is None:
            refused.append(f"{vf}: {decision.summary()}")
            continue
        if svc.licence_mode == licensing.MODE_ENFORCE:  # in warn mode a missing seat is only a warning
            with svc.sessions() as s:
                try:
                    h = svc.host_id(s)
                    gpu_row = store.upsert_gpu(s, h, c.gpu, model=_model(svc, c.gpu)) if c.gpu else None
                    licensing.acquire(s, store.upsert_vm(s, h, vm), gpu_row, _series(c.name), svc.licence_mode,
                                      actor=actor or svc.cfg.actor, host_name=svc.hostname)
                finally:
                    s.rollback()
        return {"vm": vm, "vf": vf, "type": c.type, "name": c.name, "gpu": c.gpu, "refused": refused}
    raise NoCapacity(f"VM {vm} may not get a {type_name} vGPU on {', '.join(vfs)}: " + "; ".join(refused),
                     hint="free a VF, change the VM's hostpci line, or relax the placement rules",
                     refused=refused)


def _series(name: str | None) -> str | None:
    parsed = ids.parse_type_name(name or "")
    return parsed.series if parsed else None


def reapply_vf_type(svc: Context, address: str, *, vm: str, actor: str | None = None
                    ) -> tuple[dict[str, Any], bool]:
    """(record, written): write the recorded type of `vm`'s VF again when the VF lost it (it reads 0 after a
    host reboot or driver reload). A VF whose type Proxmox owns, or another VM's VF, is refused."""
    from vgpumgr.backends import nvidia_vf

    address, vm = ids.pci_address(address), ids.vm_name(vm)
    with svc.locked():
        with svc.sessions() as s:
            row = _live_row(svc, s, address)
            rec = allocation_dict(row, s)
            kernel_owner = (row.detail or {}).get("kernel_owner")
        if rec["vm"] != vm:
            raise Conflict(f"VF {address} is recorded for VM {rec['vm'] or '(none)'}, not {vm}",
                           hint="give the domain another VF, or release that record first", vm=rec["vm"])
        if kernel_owner:
            raise Conflict(f"the type of VF {address} is written by {kernel_owner}, not by vgpumgr",
                           hint=f"let {kernel_owner} start this VM")
        want = ids.nvidia_type_id(rec["type"])
        if nvidia_vf.current(svc.host, address) == want:
            return rec, False
        try:
            nvidia_vf.set_type(svc.host, address, want)
        except Exception as e:
            svc.record_failure(audit.VGPU_CREATE, e, actor=actor, vm=vm, vgpu=address,
                               detail={"type": rec["type"], "reapplied": True})
            raise
        svc.touch(rec["gpu"], address)
        with svc.tx() as s:
            svc.event(s, audit.VGPU_CREATE, actor=actor, gpu=rec["gpu"], vm=vm, vgpu=address,
                      detail={"type": rec["type"], "backend": BACKEND_NVIDIA_VF, "reapplied": True})
        return rec, True
