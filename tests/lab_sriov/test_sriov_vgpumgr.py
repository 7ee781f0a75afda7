"""vgpumgr's own SR-IOV code on a real kernel: VF discovery, VF enable/disable, errno mapping.

The PF is the lab's emulated NVMe device (scripts/mdev-lab run --sriov N), not a display device, so
discover_gpus() does not list it; read_function() reads any PCI function. Kernel rules this relies on:
docs/sources.md §2 and §16, and drivers/pci/iov.c (sriov_numvfs_store) of 6.1.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vgpumgr.backends import common, sriov
from vgpumgr.discovery.pci import read_function
from vgpumgr.errors import Busy, InvalidInput, NotFound, VgpuError
from vgpumgr.hostfs.root import Host
from vgpumgr.model import Sriov

WANTED_VFS = int(os.environ.get("MDEVLAB_SRIOV_VFS") or 0)
HOST = Host("/")
NVME_DRIVER = Path("/sys/bus/pci/drivers/nvme")

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(
        os.environ.get("MDEVLAB_GUEST") != "1" or WANTED_VFS < 3,
        reason="runs only in an mdev lab guest booted with --sriov N (N >= 3; scripts/lab-tests)",
    ),
]


def virtfns(pf: str) -> list[str]:
    """The VF addresses as the kernel links them, without vgpumgr."""
    d = HOST.pci(pf)
    return [os.path.basename(os.readlink(d / f"virtfn{i}")) for i in range(len(list(d.glob("virtfn*"))))]


def kernel_error(pf: str, value: str) -> VgpuError:
    """What vgpumgr makes of one raw write to sriov_numvfs (it must fail)."""
    with pytest.raises(VgpuError) as e:
        common.write(HOST, HOST.pci(pf) / "sriov_numvfs", value, f"writing {value!r} to sriov_numvfs")
    return e.value


def test_set_numvfs_enables_vfs_and_changes_the_count_through_zero(nvme_pf: str) -> None:
    two = sriov.set_numvfs(HOST, nvme_pf, 2)
    assert len(two) == 2
    assert two == virtfns(nvme_pf)
    pf = read_function(HOST, nvme_pf)
    assert pf.sriov == Sriov(totalvfs=WANTED_VFS, numvfs=2, vfs=two)
    assert (pf.physfn, pf.driver) == (None, "nvme")
    for vf in two:
        f = read_function(HOST, vf)
        assert (f.physfn, f.sriov, f.driver) == (nvme_pf, None, None)  # autoprobe is off
        assert (f.vendor_id, f.device_id) == ("1b36", "0010")

    # The kernel answers EBUSY to 2 -> 3; vgpumgr writes 0 first, so the caller never sees it.
    three = sriov.set_numvfs(HOST, nvme_pf, 3)
    assert three == virtfns(nvme_pf)
    assert three[:2] == two and len(three) == 3
    assert read_function(HOST, nvme_pf).sriov == Sriov(totalvfs=WANTED_VFS, numvfs=3, vfs=three)
    assert sriov.set_numvfs(HOST, nvme_pf, 3) == three

    assert sriov.set_numvfs(HOST, nvme_pf, 0) == []
    assert not any(HOST.pci(vf).exists() for vf in three)
    assert read_function(HOST, nvme_pf).sriov == Sriov(totalvfs=WANTED_VFS, numvfs=0, vfs=[])


def test_a_count_outside_0_to_total_is_refused_before_any_write(nvme_pf: str) -> None:
    two = sriov.set_numvfs(HOST, nvme_pf, 2)
    for bad in (WANTED_VFS + 1, -1):
        with pytest.raises(InvalidInput) as e:
            sriov.set_numvfs(HOST, nvme_pf, bad)
        assert f"0..{WANTED_VFS}" in e.value.message
        assert virtfns(nvme_pf) == two  # a write (even the 0 on the way) would have removed these


def test_kernel_errnos_of_sriov_numvfs_become_vgpumgr_errors(nvme_pf: str) -> None:
    two = sriov.set_numvfs(HOST, nvme_pf, 2)
    busy = kernel_error(nvme_pf, "3")  # non-zero -> non-zero
    assert isinstance(busy, Busy)
    assert busy.detail["errno"] == "EBUSY"
    out_of_range = kernel_error(nvme_pf, str(WANTED_VFS + 1))  # the range check comes before the EBUSY one
    assert isinstance(out_of_range, InvalidInput)
    assert out_of_range.detail["errno"] == "ERANGE"
    # kstrtou16(): a negative number, or one that does not fit 16 bits, is EINVAL, not ERANGE
    for value in ("-1", "65536"):
        err = kernel_error(nvme_pf, value)
        assert isinstance(err, InvalidInput)
        assert err.detail["errno"] == "EINVAL", value
    common.write(HOST, HOST.pci(nvme_pf) / "sriov_numvfs", "2", "writing the current count")  # a no-op, no EBUSY
    assert virtfns(nvme_pf) == two


def test_without_a_pf_driver_the_kernel_checks_the_range_first_and_the_driver_last(nvme_pf: str) -> None:
    HOST.write(NVME_DRIVER / "unbind", nvme_pf)
    assert read_function(HOST, nvme_pf).driver is None
    assert read_function(HOST, nvme_pf).sriov == Sriov(totalvfs=WANTED_VFS, numvfs=0, vfs=[])
    common.write(HOST, HOST.pci(nvme_pf) / "sriov_numvfs", "0", "writing the current count")  # no ENOENT
    assert kernel_error(nvme_pf, str(WANTED_VFS + 1)).detail["errno"] == "ERANGE"
    no_driver = kernel_error(nvme_pf, "2")
    assert isinstance(no_driver, NotFound)
    assert no_driver.detail["errno"] == "ENOENT"
    with pytest.raises(InvalidInput, match="no driver is bound"):  # said before any write
        sriov.set_numvfs(HOST, nvme_pf, 2)
    assert virtfns(nvme_pf) == []
