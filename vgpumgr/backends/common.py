"""Shared pieces of the device backends: bounded writes, waiting, and who holds a device."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from vgpumgr.discovery.fs import link_name, read
from vgpumgr.errors import Timeout, VgpuError, from_oserror
from vgpumgr.hostfs.root import Host


def write(host: Host, path: Path, data: str, action: str, hint: str | None = None,
          timeout: float = 10.0) -> None:
    """Write once; turn the errno into advice; never hang longer than `timeout`.

    The real kernel can block a writer indefinitely (an mdev `remove` while a VM holds it), so the
    write runs in a daemon thread and we stop waiting after `timeout`.
    """
    if host.simulated:  # the emulator applies a write synchronously and never blocks: no watchdog thread
        try:
            host.write(path, data)
        except OSError as e:
            raise from_oserror(e, action, hint) from e
        return
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            host.write(path, data)
            result.append(None)
        except BaseException as e:  # noqa: BLE001 - handed back to the caller below
            result.append(e)

    t = threading.Thread(target=run, daemon=True, name=f"sysfs-write {path.name}")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise Timeout(f"{action}: the kernel did not answer within {timeout:g} s",
                      hint="a VM or process may still hold the device; stop it and check `dmesg`")
    err = result[0]
    if isinstance(err, OSError):
        raise from_oserror(err, action, hint) from err
    if err is not None:
        raise err


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def vfio_holders(host: Host, group: int | None, extra_targets: tuple[str, ...] = ()) -> list[str]:
    """Processes holding /dev/vfio/<group> (or another target) open, as 'comm[pid]'."""
    if group is None and not extra_targets:
        return []
    targets = set(extra_targets)
    if group is not None:
        targets.add(f"/dev/vfio/{group}")
    out = []
    proc = str(host.proc)
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        fd_dir = f"{proc}/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in targets:
                    comm = read(f"{proc}/{pid}/comm", "?") or "?"
                    out.append(f"{comm}[{pid}]")
                    break
            except OSError:
                continue
    return out


HolderCheck = Callable[[str], list[str]]
"""Extra holder lookups (for example libvirt domains using an mdev UUID or a PCI address)."""


def ensure_free(what: str, holders: list[str], error: type[VgpuError]) -> None:
    if holders:
        raise error(f"{what} is in use by {', '.join(holders)}",
                    hint="stop or detach it from that VM first (removing a device a VM holds blocks in the kernel)",
                    holders=holders)


def device_holders(host: Host, vf: str, extra: HolderCheck | None = None) -> list[str]:
    """Processes holding a PCI function through VFIO: its IOMMU group's node or its iommufd device nodes."""
    group = link_name(f"{host.pci(vf)}/iommu_group")
    found = vfio_holders(host, int(group) if group and group.isdigit() else None, _iommufd_nodes(host, vf))
    if extra:
        found += [h for h in extra(vf) if h not in found]
    return found


def _iommufd_nodes(host: Host, vf: str) -> tuple[str, ...]:
    """The VF's iommufd character devices (/dev/vfio/devices/vfioN, named by its vfio-dev/ entries):
    a QEMU using iommufd holds these open instead of the group."""
    try:
        names = os.listdir(host.pci(vf) / "vfio-dev")
    except OSError:
        return ()
    return tuple(f"/dev/vfio/devices/{n}" for n in sorted(names) if n.startswith("vfio") and n[4:].isdigit())
