"""The backend contract suite runs unchanged on the simulator and, in the mdev lab, on a real kernel.

VGPUMGR_CONTRACT_TARGET=kernel (set by scripts/lab-tests inside the guest) selects the real sysfs at /;
anything else builds the simulator's `samples` profile, which mirrors the kernel's sample drivers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from vgpumgr.discovery.mdev import discover_mdevs
from vgpumgr.hostfs.root import Host

TARGET = os.environ.get("VGPUMGR_CONTRACT_TARGET", "sim")


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    if TARGET == "kernel":
        h = Host("/")
        if not h.mdev_bus.joinpath("mtty").exists():
            pytest.fail("VGPUMGR_CONTRACT_TARGET=kernel but the mtty sample driver is not loaded")
        before = {m.uuid for m in discover_mdevs(h)}
        yield h
        for m in discover_mdevs(h):  # leave the kernel as we found it
            if m.uuid not in before:
                with contextlib.suppress(OSError):
                    h.write(h.mdev(m.uuid) / "remove", "1")
        return
    from vgpumgr.sim import profiles

    root = profiles.create(tmp_path / "sim", "samples")
    yield Host(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def hold(host: Host):  # noqa: ANN201
    """Hold a device's VFIO group open, as QEMU does: a real open() on the kernel, a fake /proc entry on the sim."""
    opened: list[int] = []
    made: list[Path] = []

    def _hold(group: int) -> str:
        if TARGET == "kernel":
            opened.append(os.open(f"/dev/vfio/{group}", os.O_RDWR))
            return f"[{os.getpid()}]"
        pid = 4242
        fd_dir = host.proc / str(pid) / "fd"
        fd_dir.mkdir(parents=True, exist_ok=True)
        (host.proc / str(pid) / "comm").write_text("qemu-system-x86\n")
        os.symlink(f"/dev/vfio/{group}", fd_dir / "20")
        made.append(host.proc / str(pid))
        return f"[{pid}]"

    yield _hold
    for fd in opened:
        os.close(fd)
    for p in made:
        shutil.rmtree(p, ignore_errors=True)
