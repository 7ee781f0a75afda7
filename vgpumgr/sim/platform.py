"""The simulator's side of `vgpumgr.host.Kernel`: a simulated root names `SimKernel` in its KERNEL_FILE, so
its writes go to the kernel emulator and its NVML is the simulated one, without the real host's code
knowing the simulator."""

from __future__ import annotations

from pathlib import Path

from vgpumgr.host import KERNEL_FILE, Host, Kernel

TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing (~7 ms): see cli/main.py
if TYPE_CHECKING:
    from typing import Any

NVML_STATE = ".vgpumgr-nvml.json"


def nvml_state_path(root: Path) -> Path:
    return Path(root) / NVML_STATE


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

    def gpu_instances_changed(self, layer: Any) -> None:
        """The driver knows its GPU instances; in the simulator sysfs must be told what NVML did."""
        from vgpumgr.sim.mig_link import sync_from_nvml

        sync_from_nvml(self.host.root, layer)
