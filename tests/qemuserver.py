"""qemu-server's order around the hookscript phases, replayed on a simulated host (docs/sources.md §13, from
qemu-server's `PVE/QemuServer.pm`, `PVE/QemuServer/PCI.pm` and `PVE/QemuServer/Helpers.pm`).

Start: pre-start hook; choose the first candidate VF that is neither reserved nor in use, reserve it in
pci-id-reservations (`time:`), write 0 then N to its current_vgpu_type (legacy: create the mdev with its UUID
scheme unless it exists); QEMU runs with `-pidfile <run dir>/<vmid>.pid` and holds the device's VFIO group
open (a process in the simulated /proc), the reservation becomes `pid:<QEMU's pid>`; post-start hook.
Stop: QEMU exits; cleanup unlinks the pid file, writes 0 to each reserved VF (legacy: removes the mdev) and
drops the VM's reservations; then the post-stop hook. Sysfs writes go through the simulated kernel, as
Proxmox's go to the real one. Every step is logged, in order.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from hookserver import PROXMOX, Server, run

from vgpumgr import ids
from vgpumgr.hostfs.root import Host

FIRST_PID = 7000


class QemuServer:
    def __init__(self, server: Server, pve: Path) -> None:
        self.server, self.pve, self.host = server, pve, Host(server.root)
        self.run_dir = server.root / "run/qemu-server"  # where the service looks by default on this root
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        for p in self.host.proc.iterdir():  # no process of an earlier test survives
            shutil.rmtree(p, ignore_errors=True)
        self.log: list[str] = []
        self.qemu: dict[int, int] = {}  # vmid -> pid of its running QEMU
        self.answers: dict[tuple[int, str], Any] = {}

    def env(self, **extra: str) -> dict[str, str]:
        paths = {"VGPUMGR_PVE_DIR": str(self.pve), "VGPUMGR_PVE_CONF_DIR": str(self.pve / "qemu-server"),
                 "VGPUMGR_PVE_RUN_DIR": str(self.run_dir), "VGPUMGR_SYSFS_ROOT": str(self.server.root),
                 "VGPUMGR_PVE_NODE": "pve1"}
        return self.server.env(**{**paths, **extra})

    def hook(self, vmid: int, phase: str) -> Any:
        r = run([str(PROXMOX), str(vmid), phase], self.env())
        self.log.append(f"{vmid} hook {phase} -> {r.returncode}")
        self.answers[(vmid, phase)] = r  # the latest, per VM and phase
        return r

    # -- pci-id-reservations: "<id> <vmid> time:<epoch>|pid:<pid>" ------------------------------------
    @property
    def reservations(self) -> Path:
        return self.run_dir / "pci-id-reservations"

    def reserved_lines(self) -> dict[str, tuple[str, str]]:
        text = self.reservations.read_text() if self.reservations.exists() else ""
        return {f[0]: (f[1], f[2]) for f in (line.split() for line in text.splitlines()) if len(f) == 3}

    def reserved(self) -> dict[str, str]:
        return {a: v for a, (v, _) in self.reserved_lines().items()}

    def write_reservations(self, entries: dict[str, tuple[str, str]]) -> None:
        self.reservations.write_text("".join(f"{a} {v} {tag}\n" for a, (v, tag) in sorted(entries.items())))

    def reserve(self, vf: str, vmid: int, tag: str) -> None:
        self.write_reservations({**self.reserved_lines(), vf: (str(vmid), tag)})

    def pidfile(self, vmid: int) -> Path:
        return self.run_dir / f"{vmid}.pid"

    # -- processes in the simulated /proc -------------------------------------------------------------
    def process(self, argv: list[str], holds: str | None = None, state: str = "S", pid: int | None = None) -> int:
        """A process with this command line (and /dev/vfio/<group> of `holds` open); its pid."""
        if pid is None:
            taken = {int(p.name) for p in self.host.proc.iterdir() if p.name.isdigit()}
            pid = next(n for n in range(FIRST_PID, FIRST_PID + 10000) if n not in taken)
        d = self.host.proc / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        comm = os.path.basename(argv[0])[:15]
        (d / "comm").write_text(comm + "\n")
        (d / "stat").write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 9 0 "
                                f"{1000 + pid} 0 0\n")
        if holds is not None:
            os.symlink(f"/dev/vfio/{self.group(holds)}", d / "fd" / "23")
        return pid

    def group(self, device: str) -> str:
        path = self.host.pci(device) if ids.is_pci_address(device) else self.host.mdev(device)
        return os.path.basename(os.readlink(path / "iommu_group"))

    def qemu_argv(self, vmid: int, device: str) -> list[str]:
        return ["/usr/bin/kvm", "-id", str(vmid), "-name", f"vm{vmid},debug-threads=on", "-pidfile",
                str(self.pidfile(vmid)), "-device", f"vfio-pci,host={device},id=hostpci0"]

    def run_qemu(self, vmid: int, device: str) -> int:
        pid = self.process(self.qemu_argv(vmid, device), holds=device)
        self.pidfile(vmid).write_text(f"{pid}\n")
        self.qemu[vmid] = pid
        return pid

    def exit_qemu(self, vmid: int) -> None:
        pid = self.qemu.pop(vmid, None)
        if pid is not None:
            shutil.rmtree(self.host.proc / str(pid), ignore_errors=True)

    # -- sysfs as Proxmox touches it ------------------------------------------------------------------
    def vf_type(self, vf: str) -> int:
        return int((self.host.pci(vf) / "nvidia/current_vgpu_type").read_text())

    def set_vf(self, vmid: int, vf: str, tid: int) -> bool:
        if self.vf_type(vf) == tid:
            return True
        try:
            self.host.write(self.host.pci(vf) / "nvidia/current_vgpu_type", "0")
        except PermissionError:
            pass  # the driver refuses 0 on a VF that holds nothing; Proxmox goes on
        self.log.append(f"{vmid} write 0 {vf}")
        creatable = (self.host.pci(vf) / "nvidia/creatable_vgpu_types").read_text().splitlines()[1:]
        if str(tid) not in {line.split(":")[0].strip() for line in creatable}:
            return False
        self.host.write(self.host.pci(vf) / "nvidia/current_vgpu_type", str(tid))
        self.log.append(f"{vmid} write {tid} {vf}")
        return True

    def _in_use(self, vf: str) -> bool:
        """What reserve_pci_usage refuses: another VM's unexpired `time:` entry, or a `pid:` entry of a VM
        whose QEMU still runs with that pid."""
        entry = self.reserved_lines().get(vf)
        if entry is None:
            return False
        vmid, tag = entry
        kind, _, value = tag.partition(":")
        if kind == "time":
            return int(value) > time.time()
        return self.qemu.get(int(vmid)) == int(value)

    def start(self, vmid: int, cands: list[str], mdev: str, index: int = 0) -> bool:
        if self.hook(vmid, "pre-start").returncode != 0:
            self.log.append(f"{vmid} start aborted")
            return False
        if (self.host.pci(cands[0]) / "nvidia").is_dir():
            tid = int(mdev.removeprefix("nvidia-"))
            for vf in cands:
                if self._in_use(vf) or self.vf_type(vf) != 0:
                    continue
                before = self.reserved_lines()
                self.reserve(vf, vmid, f"time:{int(time.time()) + 5}")
                self.log.append(f"{vmid} reserve {vf}")
                if self.set_vf(vmid, vf, tid):
                    device = vf
                    break
                self.write_reservations(before)
            else:
                self.log.append(f"{vmid} could not find a free device for 'hostpci{index}'")
                return False
        else:
            device = f"{index:08d}-0000-0000-0000-{vmid:012d}"
            if (self.host.pci(cands[0]) / device).exists():
                self.log.append(f"{vmid} reuse mdev {device}")
            else:
                self.host.write(self.host.mdev_type(cands[0], mdev) / "create", device)
                self.log.append(f"{vmid} create mdev {device}")
        pid = self.run_qemu(vmid, device)
        for vf, (owner, _) in self.reserved_lines().items():
            if owner == str(vmid):
                self.reserve(vf, vmid, f"pid:{pid}")
        self.log.append(f"{vmid} qemu started")
        self.hook(vmid, "post-start")
        return True

    def stop(self, vmid: int, legacy_uuid: str | None = None, post_stop: bool = True) -> None:
        self.exit_qemu(vmid)
        self.log.append(f"{vmid} qemu exited")
        self.pidfile(vmid).unlink(missing_ok=True)
        mine = [a for a, v in self.reserved().items() if v == str(vmid)]
        for vf in mine:
            self.host.write(self.host.pci(vf) / "nvidia/current_vgpu_type", "0")
            self.log.append(f"{vmid} cleanup write 0 {vf}")
        self.write_reservations({a: e for a, e in self.reserved_lines().items() if e[0] != str(vmid)})
        if legacy_uuid and self.host.mdev(legacy_uuid).exists():
            self.host.write(self.host.mdev(legacy_uuid) / "remove", "1")
            self.log.append(f"{vmid} cleanup remove mdev {legacy_uuid}")
        if post_stop:
            self.hook(vmid, "post-stop")
