"""The one root from which every sysfs path hangs, and the only place that reads or writes it.

`Host("/")` is the real machine. A root made by `vgpumgr sim create` carries a marker file; only
such a root (and never "/") routes writes through the kernel emulator, so the simulator is always a
choice the user made by pointing `--sysfs-root` at it.
"""

from __future__ import annotations

import os
from pathlib import Path

from vgpumgr import ids
from vgpumgr.errors import InvalidInput

SIM_MARKER = ".vgpumgr-sim.json"


class Host:
    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise InvalidInput(f"sysfs root '{root}' is not a directory",
                               hint="pass --sysfs-root DIR of an existing tree, or make one with `vgpumgr sim create`")
        self.simulated = self.root.resolve() != Path("/") and (self.root / SIM_MARKER).is_file()
        self._emulator = None

    @classmethod
    def from_env(cls, root: str | None = None) -> Host:
        return cls(root or os.environ.get("VGPUMGR_SYSFS_ROOT") or "/")

    # -- paths (only from validated ids) --------------------------------------------------------
    @property
    def sys(self) -> Path:
        return self.root / "sys"

    @property
    def pci_devices(self) -> Path:
        return self.sys / "bus/pci/devices"

    @property
    def mdev_bus(self) -> Path:
        return self.sys / "class/mdev_bus"

    @property
    def mdev_devices(self) -> Path:
        return self.sys / "bus/mdev/devices"

    @property
    def dev_vfio(self) -> Path:
        return self.root / "dev/vfio"

    @property
    def proc(self) -> Path:
        return self.root / "proc"

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
        """One write() per call, as the kernel expects; OSError carries the kernel's errno."""
        if self.simulated:
            self.emulator.write(path, data)
            return
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, data.encode())
        finally:
            os.close(fd)

    @property
    def emulator(self):  # noqa: ANN201 - imported lazily to keep the CLI start fast
        if self._emulator is None:
            if not self.simulated:
                raise RuntimeError("the kernel emulator is only used for a simulated root")
            from vgpumgr.sim.kernel import KernelEmulator

            self._emulator = KernelEmulator(self)
        return self._emulator

    def describe(self) -> str:
        return f"simulated host at {self.root}" if self.simulated else f"host sysfs at {self.root}"
