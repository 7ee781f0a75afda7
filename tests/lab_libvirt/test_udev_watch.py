"""`vgpumgr serve`'s udev watcher (api/watch.py) against the guest's real systemd-udevd: an mdev made or removed
behind vgpumgr's back on mtty re-reads that parent only, as vgpumgr's own changes do, and the whole host is not
scanned again; tests/test_watch.py checks the other events with stand-ins."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest


def _until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    pytest.fail(f"no udev event within {timeout:g} s: {what}")


def test_an_mdev_made_and_removed_behind_vgpumgrs_back_rereads_its_parent_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from api.watch import InventoryWatcher
    from vgpumgr.backends import mdev as mdev_backend
    from vgpumgr.config import Config
    from vgpumgr.ops import context
    from vgpumgr.service import Service

    cfg = Config.resolve(sysfs_root="/", state_dir=str(tmp_path / "state"), db=f"sqlite:///{tmp_path}/vgpumgr.db",
                         connect="test:///default")
    svc = Service(cfg, licence_mode="off")
    scans: list[float] = []
    full_scan = context.scan

    def counted(*a: object, **k: object) -> object:
        scans.append(time.monotonic())
        return full_scan(*a, **k)

    monkeypatch.setattr(context, "scan", counted)
    watcher = InventoryWatcher(svc)
    assert watcher.start() == "udev", "the guest runs systemd-udevd: pyudev should monitor it"
    try:
        svc.snapshot()
        assert len(scans) == 1 and svc.known_parent("mtty") == (None, "mtty")
        uid = mdev_backend.create(svc.host, "mtty", "mtty-1").uuid  # through sysfs, not the service: no touch
        try:
            _until(lambda: "mtty" in svc._dirty_gpus or svc._snapshot is None, "mdev add on mtty")
            assert svc._snapshot is not None, "the add event dropped the whole snapshot"
            assert uid in {m.uuid for m in svc.snapshot().inventory.mdevs}
        finally:
            mdev_backend.remove(svc.host, uid)
        _until(lambda: "mtty" in svc._dirty_gpus or svc._snapshot is None, "mdev remove on mtty")
        assert svc._snapshot is not None, "the remove event dropped the whole snapshot"
        assert uid not in {m.uuid for m in svc.snapshot().inventory.mdevs}
        assert len(scans) == 1  # the host was never scanned whole again
    finally:
        watcher.stop()
