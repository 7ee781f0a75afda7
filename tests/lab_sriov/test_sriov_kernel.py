"""SR-IOV facts on a real kernel: the mdev lab's emulated NVMe PF (scripts/mdev-lab run --sriov N).

Plain os calls only, so these pin down what the kernel does, independent of vgpumgr.
The expectations and their sources: docs/sources.md §2 and §16 (Linux 6.1 `drivers/pci/iov.c`, QEMU 7.2's
emulated NVMe with SR-IOV).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

WANTED_VFS = int(os.environ.get("MDEVLAB_SRIOV_VFS") or 0)
PCI_DEVICES = Path("/sys/bus/pci/devices")
QEMU_NVME = ("0x1b36", "0x0010")

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(
        os.environ.get("MDEVLAB_GUEST") != "1" or WANTED_VFS < 2,
        reason="runs only in an mdev lab guest booted with --sriov N (N >= 2; scripts/lab-tests)",
    ),
]


def write(path: Path, data: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


def errno_of(path: Path, data: str) -> int:
    with pytest.raises(OSError) as e:
        write(path, data)
    return e.value.errno


def virtfns(pf: Path) -> list[str]:
    return sorted(p.name for p in pf.glob("virtfn*"))


@pytest.fixture
def pf() -> Iterator[Path]:
    """The NVMe PF with its VFs cleared and driver autoprobe off (VFs stay unbound, as for vfio later)."""
    found = [
        d
        for d in PCI_DEVICES.iterdir()
        if (d / "sriov_totalvfs").exists()
        and ((d / "vendor").read_text().strip(), (d / "device").read_text().strip()) == QEMU_NVME
    ]
    assert len(found) == 1, f"expected one emulated NVMe PF, found {[d.name for d in found]}"
    dev = found[0]
    autoprobe = (dev / "sriov_drivers_autoprobe").read_text().strip()
    write(dev / "sriov_drivers_autoprobe", "0")
    yield dev
    with contextlib.suppress(OSError):
        write(dev / "sriov_numvfs", "0")
    write(dev / "sriov_drivers_autoprobe", autoprobe)


def test_pf_reports_its_capacity_and_starts_empty(pf: Path) -> None:
    assert int((pf / "sriov_totalvfs").read_text()) == WANTED_VFS
    assert int((pf / "sriov_numvfs").read_text()) == 0
    assert virtfns(pf) == []
    assert os.path.basename(os.readlink(pf / "driver")) == "nvme"  # sriov_numvfs needs a bound PF driver


def test_enabling_vfs_creates_linked_functions(pf: Path) -> None:
    write(pf / "sriov_numvfs", "2")
    assert int((pf / "sriov_numvfs").read_text()) == 2
    assert virtfns(pf) == ["virtfn0", "virtfn1"]
    offset = int((pf / "sriov_offset").read_text())
    stride = int((pf / "sriov_stride").read_text())
    pf_fn = int(pf.name.rsplit(".", 1)[1])
    for n in range(2):
        link = os.readlink(pf / f"virtfn{n}")
        vf = (pf / f"virtfn{n}").resolve()
        assert link == f"../{vf.name}"
        assert int(vf.name.rsplit(".", 1)[1]) == pf_fn + offset + n * stride
        assert os.readlink(vf / "physfn") == f"../{pf.name}"
        assert (vf / "vendor").read_text().strip() == QEMU_NVME[0]
        assert (vf / "driver_override").exists()
        assert not (vf / "driver").exists()  # autoprobe is off


def test_changing_a_nonzero_count_is_ebusy(pf: Path) -> None:
    write(pf / "sriov_numvfs", "2")
    assert errno_of(pf / "sriov_numvfs", "1") == errno.EBUSY
    assert errno_of(pf / "sriov_numvfs", "3") == errno.EBUSY
    assert virtfns(pf) == ["virtfn0", "virtfn1"]


def test_more_than_total_is_erange(pf: Path) -> None:
    assert errno_of(pf / "sriov_numvfs", str(WANTED_VFS + 1)) == errno.ERANGE
    assert int((pf / "sriov_numvfs").read_text()) == 0


def test_zero_removes_every_vf(pf: Path) -> None:
    write(pf / "sriov_numvfs", str(WANTED_VFS))
    vfs = [(pf / f"virtfn{n}").resolve() for n in range(WANTED_VFS)]
    write(pf / "sriov_numvfs", "0")
    assert virtfns(pf) == []
    assert not any(vf.exists() for vf in vfs)
    assert int((pf / "sriov_numvfs").read_text()) == 0
