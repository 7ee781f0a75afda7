"""api/watch.py's udev handler: an mdev event on a parent the snapshot knows re-reads that GPU only, anything
else the whole host (pyudev Devices stand in here; tests/lab_libvirt/test_udev_watch.py takes real ones)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from api.watch import InventoryWatcher
from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.config import Config
from vgpumgr.service import Service
from vgpumgr.sim import profiles

T4 = "0000:3b:00.0"


def _event(subsystem: str, parent: str | None) -> SimpleNamespace:
    return SimpleNamespace(subsystem=subsystem, parent=SimpleNamespace(sys_name=parent) if parent else None)


def test_an_mdev_event_rereads_its_gpu_and_anything_else_the_host(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPUMGR_FLEET_PUBLISH", "1")  # each change published: the GPU is marked for it
    root = profiles.create(tmp_path / "sim", "t4", scale=2)
    svc = Service(Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "state")), licence_mode="off")
    watcher = InventoryWatcher(svc)
    first = svc.snapshot()
    made = mdev_backend.create(svc.host, T4, "nvidia-232", None)  # behind vgpumgr's back, as udev would report
    watcher._on_event(_event("mdev", T4))
    assert svc._snapshot is first and svc._dirty_gpus == {T4}  # kept: only the GPU is re-read
    assert svc.fleet.per_change and svc.fleet._pending == {T4}  # and marked for the fleet
    after = svc.snapshot()
    assert after is not first and made.uuid in {m.uuid for m in after.inventory.mdevs}
    assert after.taken == first.taken  # a partial re-read keeps the full scan's time

    for event in (_event("pci", T4), _event("mdev", "0000:99:00.0"), _event("mdev", None), object()):
        svc.snapshot()
        watcher._on_event(event)
        assert svc._snapshot is None, event  # the whole host is read again
    assert made.uuid in {m.uuid for m in svc.snapshot().inventory.mdevs}


def test_an_mdev_event_on_a_vf_rereads_its_physical_gpu(tmp_path: Path) -> None:
    root = profiles.create(tmp_path / "sim", "a40-sriov", vfs=4)
    svc = Service(Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "state")), licence_mode="off")
    inv = svc.snapshot().inventory
    vf = next(g for g in inv.gpus if g.is_vf)
    InventoryWatcher(svc)._on_event(_event("mdev", vf.address))
    assert svc._snapshot is not None and svc._dirty_gpus == {vf.physfn}
