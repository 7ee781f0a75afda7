"""What Proxmox's qemu-server leaves in its run directory (/run/qemu-server), read as qemu-server reads it:
a VM's QEMU pid file (`PVE/QemuServer/Helpers.pm` `vm_running_locally`, pve-common's `check_process_running`)
and the PCI reservations (`PVE/QemuServer/PCI.pm` `reserve_pci_usage`). Local files only."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

# qemu-server's reservation lines: "<id> <vmid> time:<epoch>" or "<id> <vmid> pid:<pid>" (PCI.pm)
RESERVATION = re.compile(r"^((?:[0-9a-f]{4}:)?[0-9a-f]{2}:[0-9a-f]{2}(?:\.[0-9a-f])?)\s(\d+)\s(time|pid):(\d+)$")
QEMU_BINARY = re.compile(r"(?:kvm$)|(?:(?:^|/)qemu-system-[^/]+$)")  # what vm_running_locally accepts


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


def reserving(vf: str, found: list[Reservation], proc: Path, run_dir: Path) -> Reservation | None:
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
