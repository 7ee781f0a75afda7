"""The simulator's side of `vgpumgr.hostfs.root.Kernel`: a simulated root names `SimKernel` in its KERNEL_FILE, so
its writes go to the kernel emulator and its NVML is the simulated one, without the real host's code
knowing the simulator."""

from __future__ import annotations

from pathlib import Path

from vgpumgr.hostfs.root import KERNEL_FILE, Host, Kernel
from vgpumgr.sim.paths import NVML_STATE, nvml_state_path

TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing (~7 ms): see cli/main.py
if TYPE_CHECKING:
    from typing import Any

__all__ = ["NVML_STATE", "SimKernel", "mark", "nvml_state_path"]

def mark(root: Path) -> None:
    """Make `root` open with the simulator's kernel."""
    (Path(root) / KERNEL_FILE).write_text(f"{SimKernel.__module__}:{SimKernel.__name__}\n")


class SimKernel(Kernel):
    simulated = True

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        self._emulator = None

    def write(self, path: Path, data: str) -> None:
        if self._emulator is None:  # loaded on the first write: listings never need it
            from vgpumgr.sim.kernel import KernelEmulator

            self._emulator = KernelEmulator(self.host)
        self._emulator.write(path, data)

    def nvml_library(self) -> Any | None:
        path = nvml_state_path(self.host.root)
        if not path.exists():
            return None
        from vgpumgr.sim.nvml import SimNvml

        return SimNvml(path)

    def migration_transport(self, uri: str) -> Any | None:
        """A destination `vgpumgr+sim:///STATE` is another simulated host: libvirt's migration is played
        by vgpumgr.sim.libvirtd, hooks and all; any other URI goes to libvirt."""
        from vgpumgr.sim.libvirtd import SCHEME, SimMigration

        return SimMigration(uri) if uri.startswith(SCHEME) else None

    def gpu_instances_changed(self, layer: Any) -> None:
        """The driver knows its GPU instances; in the simulator sysfs must be told what NVML did."""
        from vgpumgr.sim.mig_link import sync_from_nvml

        sync_from_nvml(self.host.root, layer)

    def vm_started(self, name: str, xml: str) -> None:
        """No QEMU here: the domain's vGPUs become running guests of the simulated NVML."""
        from vgpumgr.sim.guest_link import started

        started(self.host, name, xml)

    def vm_stopping(self, xml: str) -> None:
        from vgpumgr.sim.guest_link import stopped

        stopped(self.host, xml)

    def unit_state(self, name: str) -> dict[str, str]:
        from vgpumgr.sim.host_platform import unit_state

        return unit_state(self.host.root, name)
