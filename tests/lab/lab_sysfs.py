"""Raw sysfs access for the lab tests: plain os calls, so a failure points at the kernel, not at vgpumgr."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

MDEV_BUS = Path("/sys/class/mdev_bus")
MDEV_DEVICES = Path("/sys/bus/mdev/devices")

IN_GUEST = os.environ.get("MDEVLAB_GUEST") == "1"
guest_only = pytest.mark.skipif(not IN_GUEST, reason="runs only inside the mdev lab guest (scripts/lab-tests)")


def sysfs_write(path: str | os.PathLike[str], data: str | bytes) -> None:
    """One open() and one write(), as the kernel sees them; OSError carries the kernel's errno."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data.encode() if isinstance(data, str) else data)
    finally:
        os.close(fd)


def type_dir(parent: str, mdev_type: str) -> Path:
    return MDEV_BUS / parent / "mdev_supported_types" / mdev_type


def available(parent: str, mdev_type: str) -> int:
    return int((type_dir(parent, mdev_type) / "available_instances").read_text())


def existing_mdevs() -> set[str]:
    return {p.name for p in MDEV_DEVICES.iterdir()} if MDEV_DEVICES.is_dir() else set()


# make_mdev(parent, type, uuid=None) -> the device's (lower-case) uuid; see conftest.make_mdev
MdevFactory = Callable[..., str]
