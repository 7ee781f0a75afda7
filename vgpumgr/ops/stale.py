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
import time
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

RELEASE_STALE = "vgpu.release-stale"
RUN_DIR_ENV = "VGPUMGR_PVE_RUN_DIR"
PROXMOX, LIBVIRT = "proxmox", "libvirt"
PVE_VM = re.compile(r"^pve-([1-9][0-9]{0,8})$")  # the hookscript's name for VM <vmid>
# qemu-server's reservation lines: "<id> <vmid> time:<epoch>" or "<id> <vmid> pid:<pid>" (PCI.pm)
RESERVATION = re.compile(r"^((?:[0-9a-f]{4}:)?[0-9a-f]{2}:[0-9a-f]{2}(?:\.[0-9a-f])?)\s(\d+)\s(time|pid):(\d+)$")
QEMU_BINARY = re.compile(r"(?:kvm$)|(?:(?:^|/)qemu-system-[^/]+$)")  # what vm_running_locally accepts


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


def qemu_running(proc: Path, pidfile: Path) -> tuple[bool | None, str]:
    """(runs, why) for the QEMU of a pid file: True, False, or None when it cannot be told."""
    try:
        text = pidfile.read_text()
    except FileNotFoundError:
        return False, f"no QEMU pid file {pidfile}"
    except OSError as e:
        return None, f"cannot read {pidfile}: {e.strerror}"
    m = re.fullmatch(r"\s*(\d{1,10})\s*", text)
    if not m:
        return None, f"{pidfile} holds no pid ({text[:20]!r})"
    pid = int(m[1])
    try:
        argv = [a.decode(errors="replace") for a in (proc / str(pid) / "cmdline").read_bytes().split(b"\0")]
        stat = (proc / str(pid) / "stat").read_bytes()
    except FileNotFoundError:
        return False, f"pid {pid} of {pidfile} is gone"
    except OSError as e:
        return None, f"cannot read /proc/{pid}: {e.strerror}"
    if not argv or not argv[0]:
        return False, f"pid {pid} of {pidfile} has exited"  # a zombie or kernel thread has no command line
    if not QEMU_BINARY.search(argv[0]):
        return False, f"pid {pid} of {pidfile} is {os.path.basename(argv[0])!r}, not a QEMU (the pid was reused)"
    named = _option(argv, "pidfile")
    if named is None or not _same_file(named, pidfile):
        return False, f"pid {pid} of {pidfile} is a QEMU with pid file {named or '(none)'} (the pid was reused)"
    state = stat[stat.rfind(b")") + 2:][:1]
    if state in (b"Z", b"X"):
        return False, f"QEMU pid {pid} has exited"
    return True, f"QEMU pid {pid} runs with {pidfile}"


def _option(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv[1:-1], start=1):
        if a in (f"-{name}", f"--{name}"):
            return argv[i + 1]
    return None


def _same_file(a: str, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


@dataclass
class Reservation:
    device: str
    vmid: int
    kind: str
    value: int

    def __str__(self) -> str:
        return f"{self.device} {self.vmid} {self.kind}:{self.value}"


def reservations(run_dir: Path) -> list[Reservation] | None:
    """qemu-server's PCI reservations; None when the file cannot be read (nothing may then count as free)."""
    try:
        lines = (run_dir / "pci-id-reservations").read_text().splitlines()
    except FileNotFoundError:
        return []
    except OSError:
        return None
    out = []
    for line in lines:
        m = RESERVATION.match(line.strip().lower())
        if m:
            device = m[1] if len(m[1]) > 7 else f"0000:{m[1]}"
            out.append(Reservation(device, int(m[2]), m[3], int(m[4])))
    return out


def _reserving(vf: str, found: list[Reservation], proc: Path, run_dir: Path) -> Reservation | None:
    """The reservation qemu-server would honour for `vf` (an entry without a function covers all of them)."""
    now = time.time()
    for r in found:
        if r.device != vf and not ("." not in r.device and vf.startswith(r.device + ".")):
            continue
        if r.kind == "time" and r.value > now:
            return r
        if r.kind == "pid":
            runs, _ = qemu_running(proc, run_dir / f"{r.vmid}.pid")
            pid = _pid_in(run_dir / f"{r.vmid}.pid")
            if runs is None or (runs and pid == r.value):
                return r
    return None


def _pid_in(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


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
        held_by = _reserving(vf, found, svc.host.proc, run_dir)
        ev["reservation"] = str(held_by) if held_by else None
    free = runs is False and ev["vf_type"] == 0 and found is not None and ev["reservation"] is None
    # the /proc scan only when everything else says free: a running VM's record costs no scan
    ev["holders"] = nvidia_vf.holders(svc.host, vf) if free else []
    return free and not ev["holders"], ev


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
    out = []
    for c in wanted:
        m = PVE_VM.match(c.vm)
        assert m is not None
        stale, c.evidence = proxmox_evidence(svc, c.ref, int(m[1]), run_dir, res)
        if stale:
            out.append(c)
    return out


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
        m = PVE_VM.match(c.vm)
        assert m is not None
        run_dir = pve_run_dir(svc)
        stale, c.evidence = proxmox_evidence(svc, c.ref, int(m[1]), run_dir, reservations(run_dir))
        return None if stale else "the VM, its VF or Proxmox's reservations changed meanwhile"
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


def note_domain(svc: Context, domain: str, xml: str) -> None:
    """Remember that libvirt has the domain (its UUID, and when it was last prepared) for a VM vgpumgr has
    records of: what makes its records judgeable once the domain is gone."""
    from vgpumgr.domain import parse_xml

    try:
        uuid = ids.mdev_uuid((parse_xml(xml).findtext("uuid") or "").strip())
    except (InvalidInput, ValueError):
        return  # no usable <uuid>: the domain's records stay out of the libvirt rule
    with svc.tx() as s:
        vm = store.get_vm(s, svc.host_id(s), ids.vm_name(domain))
        if vm is not None:
            vm.uuid, vm.updated_at = uuid, utcnow()


__all__ = ["LIBVIRT", "PROXMOX", "RELEASE_STALE", "Candidate", "find", "note_domain", "qemu_running",
           "release", "release_stale_vfs", "reservations", "sweep"]
