"""Whole-device passthrough: bind a PCI function to vfio-pci via driver_override, and give it back."""

from __future__ import annotations

import json
import os
from pathlib import Path

from vgpumgr import ids
from vgpumgr.backends.common import HolderCheck, ensure_free, vfio_holders, wait_for, write
from vgpumgr.discovery.fs import link_name
from vgpumgr.errors import Busy, InvalidInput, NotFound, VgpuError
from vgpumgr.hostfs.root import Host

VFIO = "vfio-pci"


class DriverMemory:
    """Remembers which driver a device had before vfio-pci took it (a JSON file in the state dir)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / "previous-drivers.json"

    def load(self) -> dict[str, str]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def put(self, address: str, driver: str | None) -> None:
        data = self.load()
        if driver:
            data[address] = driver
        else:
            data.pop(address, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path)


def _check(host: Host, address: str) -> str:
    address = ids.pci_address(address)
    d = host.pci(address)
    if not d.exists():
        raise NotFound(f"no PCI device {address}", hint="`vgpumgr gpus` lists the GPUs")
    if (d / "nvidia/current_vgpu_type").exists():
        raise InvalidInput(f"{address} is an NVIDIA vGPU VF",
                           hint="NVIDIA's vendor-specific VFs must stay on the nvidia driver (libvirt managed='no'); "
                                "use `vgpumgr vf set` instead of binding it to vfio-pci")
    return address


def driver(host: Host, address: str) -> str | None:
    return link_name(f"{host.pci(address)}/driver")


def bind_vfio(host: Host, address: str, memory: DriverMemory, timeout: float = 10.0) -> str | None:
    """Bind to vfio-pci; returns the previous driver (None if it was unbound or already on vfio-pci)."""
    address = _check(host, address)
    previous = driver(host, address)
    if previous == VFIO:
        return None
    d = host.pci(address)
    write(host, d / "driver_override", VFIO, f"setting driver_override of {address}")
    try:
        if previous:
            write(host, host.pci_driver(previous) / "unbind", address, f"unbinding {address} from {previous}")
        write(host, host.sys / "bus/pci/drivers_probe", address, f"probing {address} for vfio-pci")
        if not wait_for(lambda: driver(host, address) == VFIO, timeout):
            raise VgpuError(f"{address} did not bind to vfio-pci",
                            hint="is the vfio-pci module loaded? (modprobe vfio-pci)")
    except VgpuError:
        _restore(host, address, previous)
        raise
    memory.put(address, previous)
    return previous


def unbind_vfio(host: Host, address: str, memory: DriverMemory, holder_check: HolderCheck | None = None) -> str | None:
    """Give the device back to the driver it had before; returns that driver's name."""
    address = _check(host, address)
    if driver(host, address) != VFIO:
        return None
    group = link_name(f"{host.pci(address)}/iommu_group")
    found = vfio_holders(host, int(group) if group and group.isdigit() else None)
    if holder_check:
        found += holder_check(address)
    ensure_free(f"{address}", found, Busy)
    previous = memory.load().get(address)
    _restore(host, address, previous, unbind_from=VFIO)
    memory.put(address, None)
    return previous


def _restore(host: Host, address: str, previous: str | None, unbind_from: str | None = None) -> None:
    d = host.pci(address)
    write(host, d / "driver_override", "\n", f"clearing driver_override of {address}")
    if unbind_from:
        write(host, host.pci_driver(unbind_from) / "unbind", address, f"unbinding {address} from {unbind_from}")
    if previous and driver(host, address) is None:
        write(host, host.pci_driver(previous) / "bind", address, f"binding {address} back to {previous}")
