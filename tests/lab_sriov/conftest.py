"""Fixtures for the SR-IOV lab (scripts/mdev-lab run --sriov N): the emulated NVMe PF on a real kernel."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

PCI_DEVICES = Path("/sys/bus/pci/devices")
NVME_DRIVER = Path("/sys/bus/pci/drivers/nvme")
QEMU_NVME = ("0x1b36", "0x0010")


def _write(path: Path, data: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


@pytest.fixture
def nvme_pf() -> Iterator[str]:
    """The NVMe PF's address, with no VFs and driver autoprobe off (VFs stay unbound, as for vfio later).

    Afterwards: VFs cleared, nvme bound to the PF again if a test unbound it, autoprobe as it was."""
    found = [d.name for d in PCI_DEVICES.iterdir()
             if (d / "sriov_totalvfs").exists()
             and ((d / "vendor").read_text().strip(), (d / "device").read_text().strip()) == QEMU_NVME]
    assert len(found) == 1, f"expected one emulated NVMe PF, found {found}"
    dev = PCI_DEVICES / found[0]
    autoprobe = (dev / "sriov_drivers_autoprobe").read_text().strip()
    _write(dev / "sriov_drivers_autoprobe", "0")
    if int((dev / "sriov_numvfs").read_text()):
        _write(dev / "sriov_numvfs", "0")
    yield found[0]
    with contextlib.suppress(OSError):
        _write(dev / "sriov_numvfs", "0")
    if not (dev / "driver").exists():
        _write(NVME_DRIVER / "bind", found[0])
    _write(dev / "sriov_drivers_autoprobe", autoprobe)
