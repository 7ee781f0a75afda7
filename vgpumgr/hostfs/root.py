"""The one root from which every sysfs path hangs, and the only place that reads or writes it.

`Host("/")` is the real machine, whose writes go to the kernel. Writes go through a `Kernel`: the real
one does one write() per call. A tree that is not "/" may name another kernel in its `KERNEL_FILE`
(`vgpumgr sim create` names its emulator there), so the simulator is always a root the user chose
with `--sysfs-root`, and nothing outside the simulator names it.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from vgpumgr import ids
from vgpumgr.errors import InvalidInput

TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing (~7 ms): see cli/main.py
if TYPE_CHECKING:
    from typing import Any

SIM_MARKER = ".vgpumgr-sim.json"  # the simulator's state file; kept here so both sides agree on its name
KERNEL_FILE = ".vgpumgr-kernel"   # "package.module:Class" of the Kernel that applies this root's writes
UNIT_PROPERTIES = ("LoadState", "ActiveState", "SubState", "Result", "ExecMainStatus", "UnitFileState", "After")
_KERNEL_SPEC = r"vgpumgr(\.[a-z_][a-z0-9_]*)+:[A-Za-z_][A-Za-z0-9_]*"  # compiled only when a tree names one


class Kernel:
    """Applies sysfs writes and answers for the facts a driver keeps outside sysfs. This one is the
    real kernel; a simulated root supplies a subclass through its KERNEL_FILE."""

    simulated = False

    def __init__(self, host: Host) -> None:
        self.host = host

    def write(self, path: Path, data: str) -> None:
        """One write() per call, as the kernel expects; OSError carries the kernel's errno."""
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, data.encode())
        finally:
            os.close(fd)

    def nvml_library(self) -> Any | None:
        """An NVML-shaped object for this root, or None to use the system's libnvidia-ml (on "/")."""
        return None

    def gpu_instances_changed(self, layer: Any) -> None:
        """Called after MIG GPU instances were made or destroyed through NVML; the real driver needs no word."""

    def migration_transport(self, uri: str) -> Any | None:
        """What carries a domain to the host `uri` names; None: libvirt's own migration (a real host)."""
        return None

    def vm_started(self, name: str, xml: str) -> None:
        """A domain vgpumgr started: on a real host QEMU opens its vGPUs, nothing to do here."""

    def vm_stopping(self, xml: str) -> None:
        """A domain vgpumgr stops (or whose release came): on a real host QEMU lets its vGPUs go."""

    def unit_state(self, name: str) -> dict[str, str]:
        """systemd's properties of unit `name` (UNIT_PROPERTIES); {} when systemd cannot be asked. A simulated
        root answers from its own table, so `doctor` can be shown a failed unit."""
        import subprocess

        try:
            res = subprocess.run(["systemctl", "show", "--no-pager", "-p", ",".join(UNIT_PROPERTIES), "--", name],
                                 capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        if res.returncode != 0:
            return {}
        return dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)


class Host:
    def __init__(self, root: str | os.PathLike[str] = "/", kernel: type[Kernel] | None = None) -> None:
        from vgpumgr.userinput import files

        self.root = files.checked_path(root, "--sysfs-root")
        if not files.is_dir(self.root, "--sysfs-root"):
            raise InvalidInput(f"sysfs root '{root}' is not a directory",
                               hint="pass --sysfs-root DIR of an existing tree, or make one with `vgpumgr sim create`")
        self._fixed_paths()
        self.kernel = (kernel or self._named_kernel())(self)
        self.simulated = self.kernel.simulated

    def _named_kernel(self) -> type[Kernel]:
        spec_file = self.root / KERNEL_FILE
        if self.root.resolve() == Path("/") or not spec_file.is_file():
            return Kernel
        import re

        spec = spec_file.read_text().strip()
        if not re.fullmatch(_KERNEL_SPEC, spec):
            raise InvalidInput(f"{spec_file} names '{spec}', which is not a vgpumgr kernel",
                               hint="rebuild the tree with `vgpumgr sim create DIR --force`")
        module, name = spec.split(":")
        cls = getattr(importlib.import_module(module), name, None)
        if not (isinstance(cls, type) and issubclass(cls, Kernel)):
            raise InvalidInput(f"{spec_file} names '{spec}', which is not a vgpumgr kernel",
                               hint="rebuild the tree with `vgpumgr sim create DIR --force`")
        return cls

    @classmethod
    def from_env(cls, root: str | None = None) -> Host:
        return cls(root or os.environ.get("VGPUMGR_SYSFS_ROOT") or "/")

    # -- paths (only from validated ids) --------------------------------------------------------
    # The fixed directories are built once: discovery asks for them thousands of times per scan.
    def _fixed_paths(self) -> None:
        self.sys = self.root / "sys"
        self.pci_devices = self.sys / "bus/pci/devices"
        self.mdev_bus = self.sys / "class/mdev_bus"
        self.mdev_devices = self.sys / "bus/mdev/devices"
        self.dev_vfio = self.root / "dev/vfio"
        self.proc = self.root / "proc"

    def pci(self, address: str) -> Path:
        return self.pci_devices / ids.pci_address(address)

    def parent(self, parent: str) -> Path:
        return self.mdev_bus / ids.parent_name(parent)

    def mdev_type(self, parent: str, type_id: str) -> Path:
        return self.parent(parent) / "mdev_supported_types" / ids.type_dir(type_id)

    def mdev(self, uuid: str) -> Path:
        return self.mdev_devices / ids.mdev_uuid(uuid)

    def pci_driver(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise InvalidInput(f"'{name}' is not a driver name")
        return self.sys / "bus/pci/drivers" / name

    # -- I/O (reads go through vgpumgr.discovery.fs) ---------------------------------------------
    def write(self, path: Path, data: str) -> None:
        self.kernel.write(path, data)

    def describe(self) -> str:
        return f"simulated host at {self.root}" if self.simulated else f"host sysfs at {self.root}"
