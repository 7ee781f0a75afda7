"""Keep the inventory fresh: udev events on the real host, a short TTL otherwise."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from vgpumgr.service import Service

log = logging.getLogger("vgpumgr.api")
TTL_WITH_UDEV = 300.0  # udev tells us about changes; re-read now and then anyway
TTL_WITHOUT_UDEV = 2.0


class InventoryWatcher:
    """A pyudev monitor on the pci and mdev subsystems that invalidates the service's snapshot per event."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.mode = "ttl"
        self._observer = None

    def start(self) -> str:
        if self.service.host.root.resolve() != Path("/"):
            self.service.snapshot_ttl = TTL_WITHOUT_UDEV
            return self.mode
        try:
            import pyudev

            context = pyudev.Context()
            monitor = pyudev.Monitor.from_netlink(context)
            monitor.filter_by("pci")
            monitor.filter_by("mdev")
            self._observer = pyudev.MonitorObserver(monitor, callback=self._on_event, name="vgpumgr-udev")
            self._observer.daemon = True
            self._observer.start()
            self.mode = "udev"
            self.service.snapshot_ttl = TTL_WITH_UDEV
        except Exception as exc:  # no udev (containers), no permission to open the netlink socket
            log.warning("udev monitoring unavailable (%s); inventory is re-read every %g s", exc, TTL_WITHOUT_UDEV)
            self.service.snapshot_ttl = TTL_WITHOUT_UDEV
        return self.mode

    def _on_event(self, device: object) -> None:
        """An mdev made or removed on a parent the snapshot knows (each one vgpumgr makes raises one) re-reads that
        GPU only, as vgpumgr's own changes do (scripts/bench_udev.py); any other event (a PCI device, a driver
        bound, an unknown parent) the whole host."""
        touched = _mdev_parent(device)
        found = self.service.known_parent(touched) if touched else None
        if found is None:
            self.service.invalidate()
        else:
            self.service.touch(*found)

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.send_stop()
            if threading.current_thread() is not self._observer:
                self._observer.join(timeout=2)
            self._observer = None


def _mdev_parent(device: object) -> str | None:
    """The parent device's name of a pyudev mdev Device (its sysfs directory is the parent's child)."""
    if getattr(device, "subsystem", None) != "mdev":
        return None
    parent = getattr(device, "parent", None)
    name = getattr(parent, "sys_name", None)
    return name if isinstance(name, str) and name else None
