"""Differences the real-kernel lab found between the simulator and Linux 6.1, fixed in the simulator.

Each case is what the lab measured on the kernel (tests/lab_sriov, tests/lab): the simulator must answer
the same way. The same values are checked on the kernel by tests/lab_sriov/test_sriov_vgpumgr.py."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from simhost import make

from vgpumgr.hostfs.root import Host
from vgpumgr.sim.reboot import reboot

TOTAL = 32


def numvfs_errno(host: Host, value: str) -> int | None:
    try:
        host.write(host.pci("0000:41:00.0") / "sriov_numvfs", value)
    except OSError as e:
        return e.errno
    return None


def numvfs(host: Host) -> int:
    return int((host.pci("0000:41:00.0") / "sriov_numvfs").read_text())


@pytest.mark.parametrize("value, expected_errno, expected_vfs", [
    ("-1", errno.EINVAL, 0),
    ("65536", errno.EINVAL, 0),
    ("010", None, 8),  # kstrtou16 with base 0: octal
    (" 2", errno.EINVAL, 0),
    ("2 ", errno.EINVAL, 0),
    ("1_0", errno.EINVAL, 0),
    ("0b10", errno.EINVAL, 0),
    ("", None, 0),  # a 0-byte write never reaches the store function
    ("0x2", None, 2),
    ("+2", None, 2),
    ("2\n", None, 2),
    ("33", errno.ERANGE, 0),
])
def test_sriov_numvfs_parses_like_kstrtou16(tmp_path: Path, value: str, expected_errno: int | None,
                                            expected_vfs: int) -> None:
    host = make(tmp_path, "a40-sriov", vfs=0)
    assert numvfs_errno(host, value) == expected_errno
    assert numvfs(host) == expected_vfs


def test_sriov_numvfs_checks_range_and_no_op_before_the_driver(tmp_path: Path) -> None:
    host = make(tmp_path, "a40-sriov", vfs=0)
    host.write(host.pci_driver("nvidia") / "unbind", "0000:41:00.0")
    assert numvfs_errno(host, "0") is None  # the same count: success even without a driver
    assert numvfs_errno(host, str(TOTAL + 1)) == errno.ERANGE  # the range before the driver
    assert numvfs_errno(host, "2") == errno.ENOENT  # then the missing driver
    host.write(host.pci_driver("nvidia") / "bind", "0000:41:00.0")
    assert numvfs_errno(host, "2") is None and numvfs(host) == 2
    assert numvfs_errno(host, "3") == errno.EBUSY  # non-zero to non-zero, last


def test_set_numvfs_without_a_pf_driver_says_so(tmp_path: Path) -> None:
    from vgpumgr.backends import sriov
    from vgpumgr.errors import InvalidInput

    host = make(tmp_path, "a40-sriov", vfs=0)
    host.write(host.pci_driver("nvidia") / "unbind", "0000:41:00.0")
    with pytest.raises(InvalidInput, match="no driver is bound"):
        sriov.set_numvfs(host, "0000:41:00.0", 2, allow_nvidia=True)


@pytest.mark.parametrize("value, expected_errno", [("1\n", None), ("0", None), ("", None), ("abc", errno.EINVAL),
                                                   (" 1", errno.EINVAL), ("1 ", errno.EINVAL)])
def test_mdev_remove_parses_like_kstrtoul(tmp_path: Path, value: str, expected_errno: int | None) -> None:
    from vgpumgr.backends import mdev

    host = make(tmp_path, "samples")
    dev = mdev.create(host, "mtty", "mtty-1")
    try:
        host.write(host.mdev(dev.uuid) / "remove", value)
        got = None
    except OSError as e:
        got = e.errno
    assert got == expected_errno
    assert (mdev.get(host, dev.uuid) is None) == (value == "1\n")


def test_reboot_of_a_host_with_only_virtual_parents(tmp_path: Path) -> None:
    from vgpumgr.backends import mdev
    from vgpumgr.discovery.mdev import discover_mdevs

    host = make(tmp_path, "samples")
    mdev.create(host, "mtty", "mtty-2")
    lost = reboot(host.root)
    assert (lost["mdevs"], lost["vf_vgpus"], lost["vfs"], lost["gpu_instances"]) == (1, 0, {}, {})
    assert discover_mdevs(host) == []
    assert (host.mdev_type("mtty", "mtty-1") / "available_instances").read_text() == "24\n"
