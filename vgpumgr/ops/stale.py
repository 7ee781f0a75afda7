"""Stale records: a vGPU record whose VM is gone while the release that should have followed never came (a
Proxmox post-stop or a libvirt `release end` hook lost, timed out, or still waiting when the next start came).

A record is stale only on the host's own evidence, and anything that cannot be read counts as "in use":

- **Proxmox** (a VF whose type Proxmox writes, VM `pve-<vmid>`): no QEMU of the VM runs (qemu-server's test
  in `PVE/QemuServer/Helpers.pm` `vm_running_locally`: the pid in `<run dir>/<vmid>.pid` is a live process
  whose command line is a QEMU started with `-pidfile` naming that file, so a reused pid does not count,
  nor does a zombie: pve-common's `check_process_running`);
  the VF exists and holds no vGPU type (Proxmox's cleanup wrote 0); no reservation in `pci-id-reservations`
  that qemu-server would honour names it (`PVE/QemuServer/PCI.pm` `reserve_pci_usage`: a `time:` entry not
  yet expired, or a `pid:` entry whose VM runs with that pid); no process holds its VFIO group or iommufd
  node open. Only local files are read, so the pre-start hook may ask.
- **Proxmox, legacy mdev** (`hostpciN: <GPU>,mdev=<type>`, made by the hookscript's pre-start): no QEMU of the
  VM runs (the same test) and the mdev is gone (qemu-server's cleanup removes it when the VM stops). A start
  in progress is never caught: its pre-start makes the mdev under the host lock before the record is final.
- **libvirt** (a VM whose domain libvirt knew: `vm create` or the libvirt hook's `prepare` noted its UUID):
  libvirt has no domain of that name or UUID, no domain names the device, and no process holds its VFIO
  group. libvirt is asked only by `reconcile`, never from inside a hook, at the service's start or under
  the host lock: libvirtd answers nothing while one of its hooks runs, and that hook may be waiting for
  the service or the lock.

`reconcile` reports both kinds and `reconcile --fix` releases them; the service's start releases Proxmox's,
and Proxmox's pre-start those on its candidate VFs. Releasing returns the seat and, for a libvirt record,
removes the device (a Proxmox VF's type is Proxmox's and is never written); it is audited as
`vgpu.release-stale` with the evidence, taken again under the host lock just before, so a VM that started
meanwhile keeps its record.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select

from vgpumgr import ids
from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.backends import nvidia_vf
from vgpumgr.db import store
from vgpumgr.db.models import ALLOC_ACTIVE, utcnow
from vgpumgr.db.models import Allocation as AllocRow
from vgpumgr.db.models import Vm as VmRow
from vgpumgr.errors import InvalidInput, VgpuError
from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF
from vgpumgr.ops.allocate import KERNEL_OWNER_PROXMOX
from vgpumgr.ops.context import OK, Context
from vgpumgr.ops.records import allocation_dict
from vgpumgr.platforms.pve_run import Reservation, qemu_running, reservations, reserving

RELEASE_STALE = "vgpu.release-stale"
RUN_DIR_ENV = "VGPUMGR_PVE_RUN_DIR"
PROXMOX, LIBVIRT = "proxmox", "libvirt"
PVE_VM = re.compile(r"^pve-([1-9][0-9]{0,8})$")  # the hookscript's name for VM <vmid>


# -- the evidence ------------------------------------------------------------------------------------

@dataclass
class Candidate:
    """A live record that may be stale, with what its staleness is judged on."""

    id: int
    ref: str
    vm: str
    kind: str
    backend: str
    type: str
    gpu: str | None
    vm_uuid: str | None = None
    vm_seen: datetime | None = None  # the VM row's updated_at when libvirt was asked
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "vgpu": self.ref, "vm": self.vm, "kind": self.kind, "backend": self.backend,
                "type": self.type, "gpu": self.gpu, "evidence": self.evidence}


def pve_run_dir(svc: Context) -> Path:
    """Proxmox's run directory: VGPUMGR_PVE_RUN_DIR, else run/qemu-server under the host root (/run/qemu-server)."""
    raw = os.environ.get(RUN_DIR_ENV)
    if not raw:
        return svc.host.root / "run/qemu-server"
    if "\0" in raw or not os.path.isabs(raw) or ".." in raw.split("/"):
        raise InvalidInput(f"{RUN_DIR_ENV}={raw!r} is not an absolute path without '..'",
                           hint="unset it (Proxmox's /run/qemu-server) or name the directory qemu-server uses")
    return Path(raw)


def proxmox_evidence(svc: Context, vf: str, vmid: int, run_dir: Path,
                     found: list[Reservation] | None) -> tuple[bool, dict[str, Any]]:
    """(stale, evidence) for the record of VM `vmid` on `vf`, whose type Proxmox writes."""
    ev: dict[str, Any] = {"vmid": vmid}
    runs, ev["qemu"] = qemu_running(svc.host.proc, run_dir / f"{vmid}.pid")
    try:
        ev["vf_type"] = nvidia_vf.current(svc.host, vf)
    except VgpuError as e:
        ev["vf_type"] = None
        ev["vf"] = e.message
    if found is None:
        ev["reservation"] = f"cannot read {run_dir / 'pci-id-reservations'}"
    else:
        held_by = reserving(vf, found, svc.host.proc, run_dir)
        ev["reservation"] = str(held_by) if held_by else None
    free = runs is False and ev["vf_type"] == 0 and found is not None and ev["reservation"] is None
    # the /proc scan only when everything else says free: a running VM's record costs no scan
    ev["holders"] = nvidia_vf.holders(svc.host, vf) if free else []
    return free and not ev["holders"], ev


def proxmox_mdev_evidence(svc: Context, uuid: str, vmid: int, run_dir: Path) -> tuple[bool, dict[str, Any]]:
    """(stale, evidence) for the legacy mdev `uuid` of VM `vmid`, which qemu-server removes when the VM stops."""
    ev: dict[str, Any] = {"vmid": vmid}
    runs, ev["qemu"] = qemu_running(svc.host.proc, run_dir / f"{vmid}.pid")
    ev["mdev"] = "present" if svc.host.mdev(uuid).exists() else "gone"
    return runs is False and ev["mdev"] == "gone", ev


def _judge_proxmox(svc: Context, c: Candidate, run_dir: Path, found: list[Reservation] | None) -> bool:
    """Whether the Proxmox record `c` is stale now; its evidence is refreshed."""
    m = PVE_VM.match(c.vm)
    assert m is not None
    if c.backend == BACKEND_MDEV:
        stale, c.evidence = proxmox_mdev_evidence(svc, c.ref, int(m[1]), run_dir)
    else:
        stale, c.evidence = proxmox_evidence(svc, c.ref, int(m[1]), run_dir, found)
    return stale


def _holders(svc: Context, c: Candidate) -> list[str]:
    if c.backend == BACKEND_MDEV:
        dev = mdev_backend.get(svc.host, c.ref)
        return mdev_backend.holders(svc.host, dev) if dev is not None else []
    return nvidia_vf.holders(svc.host, c.ref) if svc.host.pci(c.ref).exists() else []


# -- finding them --------------------------------------------------------------------------------

def candidates(svc: Context, vfs: set[str] | None = None) -> list[Candidate]:
    """Live, finished (no operation owns them) records of a VM that could be stale, Proxmox's and libvirt's
    (only those on `vfs` when given): one query."""
    stmt = (select(AllocRow, VmRow.name, VmRow.uuid, VmRow.updated_at).join(VmRow, VmRow.id == AllocRow.vm_id)
            .where(AllocRow.state == ALLOC_ACTIVE, AllocRow.owner_pid.is_(None)).order_by(AllocRow.id))
    if vfs is not None:
        stmt = stmt.where(AllocRow.pci_address.in_(sorted(vfs)))
    out = []
    with svc.reads() as s:
        for row, name, vm_uuid, seen in s.execute(stmt.where(AllocRow.host_id == svc.host_id(s))):
            detail = row.detail or {}
            ref = row.uuid or row.pci_address
            if ref is None:
                continue
            if detail.get("kernel_owner") == KERNEL_OWNER_PROXMOX:
                if row.pci_address and PVE_VM.match(name):
                    out.append(Candidate(row.id, ref, name, PROXMOX, row.backend, row.type_id, detail.get("gpu")))
            elif PVE_VM.match(name) and row.backend == BACKEND_MDEV and row.uuid:
                out.append(Candidate(row.id, ref, name, PROXMOX, row.backend, row.type_id, detail.get("gpu")))
            elif vm_uuid and not PVE_VM.match(name) and not detail.get("kernel_owner"):
                out.append(Candidate(row.id, ref, name, LIBVIRT, row.backend, row.type_id, detail.get("gpu"),
                                     vm_uuid=vm_uuid, vm_seen=seen))
    return out


def ask_libvirt(svc: Context, found: list[Candidate]) -> tuple[list[Candidate], str | None]:
    """The libvirt candidates whose domain libvirt no longer has and whose device no domain names, with
    libvirt's answers as evidence; and why libvirt could not be asked (then none). Call it outside the
    host lock, never from a hook."""
    wanted = [c for c in found if c.kind == LIBVIRT]
    if not wanted:
        return [], None
    gone = []
    try:
        with svc.virt() as v:
            domains = v.list()
            names = {d["name"] for d in domains}
            uuids = {d["uuid"].lower() for d in domains}
            for c in wanted:
                if c.vm in names or (c.vm_uuid or "").lower() in uuids:
                    continue
                using = v.domains_using_mdev(c.ref) if c.backend == BACKEND_MDEV else v.domains_using_pci(c.ref)
                if using:
                    continue
                c.evidence = {"domain": f"libvirt ({svc.cfg.libvirt_uri}) has no domain {c.vm} "
                                        f"or with UUID {c.vm_uuid}", "domains_using_device": []}
                gone.append(c)
    except VgpuError as e:
        return [], f"libvirt could not be asked: {e.message}"
    return gone, None


def _proxmox_stale(svc: Context, found: list[Candidate]) -> list[Candidate]:
    wanted = [c for c in found if c.kind == PROXMOX]
    if not wanted:
        return []
    run_dir = pve_run_dir(svc)
    res = reservations(run_dir)
    return [c for c in wanted if _judge_proxmox(svc, c, run_dir, res)]


def find(svc: Context, *, libvirt: bool = True) -> tuple[list[Candidate], str | None]:
    """The stale records of this host with their evidence (libvirt's only when `libvirt`), and why libvirt
    could not be asked, if it could not. Takes no lock for libvirt's part."""
    found = candidates(svc)
    gone, why = ask_libvirt(svc, found) if libvirt else ([], None)
    for c in gone:
        c.evidence["holders"] = _holders(svc, c)
    return _proxmox_stale(svc, found) + [c for c in gone if not c.evidence["holders"]], why


# -- releasing them ----------------------------------------------------------------------------------

def _still_stale(svc: Context, c: Candidate) -> str | None:
    """Under the host lock: None when `c` is still stale (its evidence refreshed), else what changed."""
    with svc.reads() as s:
        row = s.get(AllocRow, c.id)
        if row is None or row.state != ALLOC_ACTIVE or row.owner_pid is not None:
            return "the record was released or taken by an operation meanwhile"
        vm = s.get(VmRow, row.vm_id) if row.vm_id is not None else None
        if vm is None or vm.name != c.vm:
            return "the record changed hands meanwhile"
        if c.kind == LIBVIRT and (vm.uuid != c.vm_uuid or vm.updated_at != c.vm_seen):
            return f"domain {c.vm} was prepared again since libvirt was asked"
    if c.kind == PROXMOX:
        run_dir = pve_run_dir(svc)
        stale = _judge_proxmox(svc, c, run_dir, reservations(run_dir))
        return None if stale else "the VM, its device or Proxmox's reservations changed meanwhile"
    c.evidence["holders"] = _holders(svc, c)
    return None if not c.evidence["holders"] else f"held by {', '.join(c.evidence['holders'])}"


def release(svc: Context, c: Candidate, actor: str | None = None) -> dict[str, Any]:
    """Release one stale record (checked again under the host lock first): 'released', 'kept' or 'failed'."""
    with svc.locked():
        changed = _still_stale(svc, c)
        if changed is not None:
            return {**c.as_dict(), "action": "kept", "why": changed}
        removed = False
        try:
            if c.kind == LIBVIRT and c.backend == BACKEND_MDEV and mdev_backend.get(svc.host, c.ref) is not None:
                removed = mdev_backend.remove(svc.host, c.ref)
            elif c.kind == LIBVIRT and c.backend == BACKEND_NVIDIA_VF and svc.host.pci(c.ref).exists():
                removed = nvidia_vf.clear_type(svc.host, c.ref, retries=1)
        except VgpuError as e:
            svc.record_failure(RELEASE_STALE, e, actor=actor, vm=c.vm, vgpu=c.ref, gpu=c.gpu,
                               detail={"kind": c.kind, "evidence": c.evidence})
            return {**c.as_dict(), "action": "failed", "error": e.message}
        if removed:
            svc.invalidate()
        with svc.tx() as s:
            row = s.get(AllocRow, c.id)
            licence = allocation_dict(row, s, vm_name=c.vm)["licence"]
            if not store.release_live(s, row):
                return {**c.as_dict(), "action": "kept", "why": "released meanwhile"}
            svc.event(s, RELEASE_STALE, OK, actor=actor, vm=c.vm, vgpu=c.ref, gpu=c.gpu,
                      detail={"kind": c.kind, "allocation_id": c.id, "type": c.type, "backend": c.backend,
                              "licence_returned": licence, "device_removed": removed, "evidence": c.evidence})
    return {**c.as_dict(), "action": "released", "licence_returned": licence, "device_removed": removed}


def sweep(svc: Context, *, libvirt: bool = True, actor: str | None = None) -> dict[str, Any]:
    """Find and release this host's stale records: what was done per record."""
    found, why = find(svc, libvirt=libvirt)
    done = [release(svc, c, actor) for c in found]
    return {"stale_records": done, "libvirt": why}


def release_stale_vfs(svc: Context, vfs: list[str], actor: str | None = None) -> list[dict[str, Any]]:
    """Proxmox's pre-start: release the stale records of other VMs on these candidate VFs (local evidence
    only), so that the start is judged on what the host really holds."""
    found = [c for c in candidates(svc, {ids.pci_address(v) for v in vfs}) if c.kind == PROXMOX]
    return [release(svc, c, actor) for c in _proxmox_stale(svc, found)]


def release_stale_mdevs(svc: Context, actor: str | None = None) -> int:
    """Proxmox's pre-start of a legacy mdev card that found no room: release the legacy-mdev records that lost
    post-stops left (local evidence only); how many went."""
    found = [c for c in candidates(svc) if c.kind == PROXMOX and c.backend == BACKEND_MDEV]
    return sum(release(svc, c, actor)["action"] == "released" for c in _proxmox_stale(svc, found))


def note_domain(svc: Context, domain: str, xml: str) -> None:
    """Remember that libvirt has the domain (its UUID, and when it was last prepared) for a VM vgpumgr has
    records of: what makes its records judgeable once the domain is gone."""
    from vgpumgr.virt.domain import parse_xml

    try:
        uuid = ids.mdev_uuid((parse_xml(xml).findtext("uuid") or "").strip())
    except (InvalidInput, ValueError):
        return  # no usable <uuid>: the domain's records stay out of the libvirt rule
    with svc.tx() as s:
        vm = store.get_vm(s, svc.host_id(s), ids.vm_name(domain))
        if vm is not None:
            vm.uuid, vm.updated_at = uuid, utcnow()


__all__ = ["LIBVIRT", "PROXMOX", "RELEASE_STALE", "Candidate", "find", "note_domain", "qemu_running",
           "release", "release_stale_mdevs", "release_stale_vfs", "reservations", "sweep"]
