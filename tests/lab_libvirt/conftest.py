"""Fixtures for tests against a real libvirtd in the mdev lab guest (scripts/mdev-lab run --libvirt).

The guest runs systemd-udevd and libvirtd 9.0 (qemu:///system, no cgroups/namespaces/security driver,
domains as root; type='qemu' since the lab itself runs under TCG; the kvm modules udev loads are unloaded
before the tests, see pytest_configure). libvirt's node-device driver knows only
mtty as an mdev_types parent (its udev backend hard-codes that class), so use mtty for nodedev tests.
Every test here is skipped outside such a guest.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

LIBVIRT_URI = "qemu:///system"
MTTY_TYPES = Path("/sys/class/mdev_bus/mtty/mdev_supported_types")
MDEV_DEVICES = Path("/sys/bus/mdev/devices")


def _in_libvirt_guest() -> bool:
    return os.environ.get("MDEVLAB_GUEST") == "1" and os.environ.get("MDEVLAB_LIBVIRTD") == "1"


def pytest_configure(config: pytest.Config) -> None:
    if not _in_libvirt_guest():
        return
    # udev loads kvm_amd in the guest (TCG emulates SVM for -cpu max), so libvirt would run nested KVM on
    # emulated SVM: untested ground that once left a lab run hanging. Nested guests here are TCG only.
    for module in ("kvm_amd", "kvm_intel", "kvm"):
        if Path(f"/sys/module/{module}").exists():
            subprocess.run(["rmmod", module], capture_output=True, timeout=60)
    # libvirtd probes QEMU's capabilities on first use (~5 s under TCG, the guest's cache starts empty):
    # let it do that while the tests import vgpumgr, not during the first domain start.
    config._libvirt_warmup = subprocess.Popen(  # type: ignore[attr-defined]
        ["virsh", "-c", LIBVIRT_URI, "domcapabilities", "--virttype", "qemu"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_unconfigure(config: pytest.Config) -> None:
    warmup = getattr(config, "_libvirt_warmup", None)
    if warmup is not None:
        warmup.wait(timeout=60)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _in_libvirt_guest():
        return
    skip = pytest.mark.skip(reason="needs the mdev lab guest with libvirtd (scripts/mdev-lab run --libvirt)")
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.lab)
            item.add_marker(skip)


def _sysfs_write(path: Path, data: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


@pytest.fixture
def virt_conn() -> Iterator[object]:
    """An open libvirt connection to the guest's libvirtd (libvirt-python's virConnect)."""
    import libvirt

    conn = libvirt.open(LIBVIRT_URI)
    yield conn
    conn.close()


@pytest.fixture
def virsh() -> Iterator[object]:
    """virsh(*args) -> CompletedProcess, against the guest's libvirtd; check it yourself."""

    def _virsh(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["virsh", "-c", LIBVIRT_URI, *args], capture_output=True, text=True, timeout=120)

    yield _virsh


@pytest.fixture
def mtty_mdev() -> Iterator[str]:
    """A fresh mtty-1 mdev created through sysfs; removed afterwards unless a test already did."""
    uid = str(uuid.uuid4())
    _sysfs_write(MTTY_TYPES / "mtty-1" / "create", uid)
    yield uid
    with contextlib.suppress(FileNotFoundError):
        _sysfs_write(MDEV_DEVICES / uid / "remove", "1")


@pytest.fixture
def domain_cleanup(virt_conn: object) -> Iterator[list[str]]:
    """Append a domain name; after the test it is destroyed (if running) and undefined."""
    import libvirt

    names: list[str] = []
    yield names
    for name in names:
        try:
            dom = virt_conn.lookupByName(name)  # type: ignore[attr-defined]
        except libvirt.libvirtError:
            continue
        if dom.isActive():
            dom.destroy()
        dom.undefine()


@pytest.fixture
def vm_cleanup(virt_conn: object) -> Iterator[list[str]]:
    """Append a domain name; afterwards it is destroyed and undefined, and then every mdev that appeared
    during the test is removed (in that order: removing an mdev a running VM holds blocks the writer)."""
    import libvirt

    before = set(os.listdir(MDEV_DEVICES)) if MDEV_DEVICES.is_dir() else set()
    names: list[str] = []
    yield names
    for name in names:
        try:
            dom = virt_conn.lookupByName(name)  # type: ignore[attr-defined]
        except libvirt.libvirtError:
            continue
        if dom.isActive():
            dom.destroy()
        dom.undefine()
    for uid in set(os.listdir(MDEV_DEVICES)) - before:
        with contextlib.suppress(FileNotFoundError):
            _sysfs_write(MDEV_DEVICES / uid / "remove", "1")
