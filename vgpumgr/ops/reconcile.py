"""Records against sysfs: recorded vGPUs that vanished (after a reboot or driver reload), devices nobody
recorded, dead reservations (left by a process that died mid-operation, or whose lease expired) and stale
records (a VM gone while its release hook never came, ops/stale.py); `fix` re-creates the first, rolls back
the third, releases the fourth and, if asked, removes the second."""

from __future__ import annotations

from typing import Any

from vgpumgr.audit import chain as audit
from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.backends import nvidia_vf
from vgpumgr.errors import Conflict, VgpuError
from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF, BACKEND_VF
from vgpumgr.ops import allocate as alloc
from vgpumgr.ops import leases, restore_vendor, stale, vgpu_mode
from vgpumgr.ops import scheduler as scheduler_ops
from vgpumgr.ops.context import FAILED, OK, WARNING, Context, suppress
from vgpumgr.ops.restore_vendor import ensure_vnpu_mode


def reconcile(svc: Context, *, fix: bool = False, remove_unknown: bool = False, actor: str | None = None
              ) -> dict[str, Any]:
    """Compare records with sysfs: recorded vGPUs that vanished, and devices nobody recorded."""
    found_stale, unchecked = stale.find(svc)  # before the host lock: libvirt may be asked
    with svc.locked():
        dead = leases.find_dead(svc)
        skip = {d.id for d in dead} | {c.id for c in found_stale}
        inv = svc.snapshot(refresh=True).inventory
        # A dead reservation or a stale record is not "missing": its device must never be re-created.
        live = [a for a in alloc.allocations(svc, live=True) if a["id"] not in skip]
        mdevs = {m.uuid: m for m in inv.mdevs}
        vfs = {v.address: v for v in inv.vf_vgpus}
        missing, unknown, restored, removed, errors = [], [], [], [], []
        for a in live:
            if a["kernel_owner"]:
                continue  # its type is written by its owner (Proxmox) when the VM starts, never by vgpumgr
            if a["backend"] == BACKEND_MDEV and a["uuid"] not in mdevs:
                missing.append(a)
            elif a["backend"] == BACKEND_NVIDIA_VF and a["pci_address"] not in vfs:
                missing.append(a)
            elif a["backend"] == BACKEND_VF and inv.gpu(a["pci_address"] or "") is None:
                missing.append(a)  # another vendor's VF slice: the VF itself is gone (its PF's VFs disabled)
        recorded = {a["uuid"] for a in live if a["uuid"]} | {a["pci_address"] for a in live if a["pci_address"]}
        recorded |= {d.ref for d in dead} | {c.ref for c in found_stale}  # the rollback's or release's to remove
        rolled_back: list[dict[str, Any]] = []
        stale_done: list[dict[str, Any]] = []
        unknown = [m.to_json() for m in inv.mdevs if m.uuid not in recorded]
        unknown += [v.to_json() for v in inv.vf_vgpus if v.address not in recorded]
        if fix:
            for d in dead:
                done = leases.roll_back(svc, d, actor)
                rolled_back.append(done)
                if done["action"] == "failed":
                    errors.append(f"{d.ref}: {done['error']}")
            for c in found_stale:
                done = stale.release(svc, c, actor)  # its evidence taken again under the lock
                stale_done.append(done)
                if done["action"] == "failed":
                    errors.append(f"{c.ref}: {done['error']}")
            # a vGPU made on a GPU whose mixed-size mode the driver lost would keep the mode from being set again
            lost_mode = {d["gpu"] for d in vgpu_mode.drift(svc, inv)}
            for a in missing:
                try:
                    if a["backend"] == BACKEND_VF:
                        raise VgpuError(f"VF {a['pci_address']} is gone", hint="`vgpumgr restore` enables the "
                                        "recorded VFs (and the vendor's steps before them)")
                    restored.append(remake(svc, a, actor, lost_mode))
                except VgpuError as e:
                    errors.append(f"{a.get('uuid') or a.get('pci_address')}: {e}")
            if remove_unknown:
                for u in unknown:
                    ref = u.get("uuid") or u.get("address")
                    try:
                        if "uuid" in u:
                            mdev_backend.remove(svc.host, u["uuid"])
                        else:
                            nvidia_vf.clear_type(svc.host, u["address"], retries=1)
                        removed.append(ref)
                    except VgpuError as e:
                        errors.append(f"{ref}: {e}")
            svc.invalidate()
        report = {"missing": [a.get("uuid") or a.get("pci_address") for a in missing],
                  "missing_detail": missing, "unknown": unknown,
                  "dead_reservations": rolled_back if fix else [d.as_dict() for d in dead],
                  "stale_records": stale_done if fix else [c.as_dict() for c in found_stale],
                  "stale_unchecked": unchecked,
                  "restored": restored, "removed": removed, "errors": errors, "fixed": fix}
        report["scheduler_drift"] = scheduler_ops.drift_report(svc.cfg, fix=fix, actor=actor)
        report["vgpu_mode_drift"] = vgpu_mode.drift(svc, svc.snapshot().inventory)
        report["vendor_drift"] = restore_vendor.drift(svc, svc.snapshot().inventory)
        unfixed = report["vgpu_mode_drift"] or report["vendor_drift"]  # only `restore` sets these again
        differs = missing or unknown or dead or found_stale or report["scheduler_drift"] or unfixed
        with svc.tx() as s:
            outcome = FAILED if errors else (WARNING if (differs and not fix) or unfixed else OK)
            svc.event(s, audit.RECONCILE, outcome, actor=actor,
                       detail={k: v for k, v in report.items() if k != "missing_detail"})
        return report


def remake(svc: Context, a: dict[str, Any], actor: str | None, lost_mode: set[str]) -> str:
    """Make a recorded mdev or NVIDIA VF type again (reconcile --fix, a VM's start): the card's vNPU VM mode first,
    its recorded placement ID after; refused on a GPU that lost its recorded mixed-size mode (`lost_mode`), where
    a vGPU would keep `restore` from setting the mode. Returns its reference."""
    if (a["gpu"] or a["parent"]) in lost_mode:
        raise Conflict(f"GPU {a['gpu'] or a['parent']} lost its recorded vGPU mode",
                       hint="`vgpumgr restore` sets the mode again before it makes the vGPUs")
    if a["backend"] == BACKEND_MDEV:
        ensure_vnpu_mode(svc, a["parent"], a["type"], actor)  # an Ascend vNPU needs VM mode
        mdev_backend.create(svc.host, a["parent"], a["type"], a["uuid"])
    else:
        nvidia_vf.set_type(svc.host, a["pci_address"], a["type"])
    _give_placement(svc, a)
    return a["uuid"] if a["backend"] == BACKEND_MDEV else a["pci_address"]


def _give_placement(svc: Context, a: dict[str, Any]) -> None:
    """A vGPU made again gets the placement ID vgpumgr chose for it (mixed size), read back; refused, it goes
    again (still missing: `vgpumgr restore` makes it in the driver's order)."""
    want = a.get("placement_id")
    if want is None or a.get("placement_by") == "driver":
        return
    from vgpumgr.backends import placement_id as pid_backend

    mdev = a["backend"] == BACKEND_MDEV
    d = pid_backend.device_dir(svc.host, uuid=a["uuid"] if mdev else None, vf=None if mdev else a["pci_address"])
    try:
        pid_backend.apply(svc.host, d, int(want))
    except VgpuError:
        with suppress():
            if mdev:
                mdev_backend.remove(svc.host, a["uuid"])
            else:
                nvidia_vf.clear_type(svc.host, a["pci_address"], retries=1)
        raise
