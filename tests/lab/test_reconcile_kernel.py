"""vgpumgr's reconcile on the real kernel: a driver reload deletes mdevs behind vgpumgr's back, as a reboot does.

`rmmod mtty` succeeds while mdevs exist and silently deletes them (docs/sources.md §1, measured by this lab).
The records stay in vgpumgr's database, so reconcile must report them missing and, with fix=True, re-create
them with the same UUIDs. An mdev made through sysfs directly is unknown to vgpumgr and is removed only when
asked. Every mdev made here is removed afterwards (make_mdev's teardown), and mtty is loaded again.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from lab_sysfs import MDEV_BUS, MDEV_DEVICES, MdevFactory, available, existing_mdevs, guest_only

from vgpumgr.config import Config
from vgpumgr.service import Service

pytestmark = [pytest.mark.lab, guest_only]

PARENT = "mtty"
PORTS = 24  # MAX_MTTYS: mtty-1 takes one port of the shared pool, mtty-2 two


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)


def mdev_type_of(uid: str) -> str:
    return os.path.basename(os.readlink(MDEV_DEVICES / uid / "mdev_type"))


@pytest.fixture
def service(tmp_path: Path, make_mdev: MdevFactory) -> Service:
    """A Service on the real sysfs with its own database; make_mdev's teardown removes every mdev it made."""
    cfg = Config.resolve(sysfs_root="/", state_dir=str(tmp_path / "state"), db=f"sqlite:///{tmp_path}/vgpumgr.db",
                         connect="test:///default")
    return Service(cfg, licence_mode="off")


@pytest.fixture
def unload_mtty() -> Iterator[Callable[[], None]]:
    """unload_mtty() runs `rmmod mtty`; mtty is loaded again afterwards, whatever the test did."""
    yield lambda: run("rmmod", PARENT)
    if not (MDEV_BUS / PARENT).exists():
        run("modprobe", PARENT)


def test_reconcile_restores_the_mdevs_a_driver_reload_deleted(
        service: Service, unload_mtty: Callable[[], None]) -> None:
    made = {str(uuid.uuid4()): "mtty-1", str(uuid.uuid4()): "mtty-2"}
    for uid, mdev_type in made.items():
        a = service.allocate(mdev_type, vm="lab-vm1", uuid=uid)
        assert (a["uuid"], a["parent"], a["type"], a["state"]) == (uid, PARENT, mdev_type, "active")
        assert mdev_type_of(uid) == mdev_type
    assert service.reconcile()["missing"] == []

    unload_mtty()
    assert not (MDEV_BUS / PARENT).exists()
    assert existing_mdevs() & set(made) == set()
    # A host that booted before its vendor driver loaded: the records are missing and cannot be restored yet.
    early = service.reconcile(fix=True)
    assert sorted(early["missing"]) == sorted(made)
    assert early["restored"] == []
    assert sorted(e.split(":", 1)[0] for e in early["errors"]) == sorted(made)
    assert all(f"no mdev parent {PARENT}" in e for e in early["errors"])

    run("modprobe", PARENT)
    assert existing_mdevs() & set(made) == set()
    assert available(PARENT, "mtty-1") == PORTS  # the reloaded driver starts with an empty pool
    report = service.reconcile()
    assert sorted(report["missing"]) == sorted(made)
    assert (report["unknown"], report["restored"], report["errors"]) == ([], [], [])
    assert existing_mdevs() & set(made) == set()  # reporting alone changes nothing

    fixed = service.reconcile(fix=True)
    assert sorted(fixed["restored"]) == sorted(made)
    assert fixed["errors"] == []
    for uid, mdev_type in made.items():
        assert (MDEV_DEVICES / uid).resolve().parent == (MDEV_BUS / PARENT).resolve()
        assert mdev_type_of(uid) == mdev_type
    assert available(PARENT, "mtty-1") == PORTS - 3
    again = service.reconcile()
    assert (again["missing"], again["unknown"]) == ([], [])
    assert sorted(a["uuid"] for a in service.allocations(live=True)) == sorted(made)


def test_reconcile_reports_an_unknown_mdev_and_removes_it_only_when_asked(
        service: Service, make_mdev: MdevFactory) -> None:
    ours = service.allocate("mtty-1", vm="lab-vm2")["uuid"]
    stray = make_mdev(PARENT, "mtty-2")  # through sysfs, behind vgpumgr's back

    report = service.reconcile()
    assert report["missing"] == []
    assert [(u["uuid"], u["parent"], u["type"]) for u in report["unknown"]] == [(stray, PARENT, "mtty-2")]

    kept = service.reconcile(fix=True)
    assert (kept["removed"], kept["errors"]) == ([], [])
    assert (MDEV_DEVICES / stray).exists()

    cleaned = service.reconcile(fix=True, remove_unknown=True)
    assert (cleaned["removed"], cleaned["errors"]) == ([stray], [])
    assert not (MDEV_DEVICES / stray).exists()
    assert mdev_type_of(ours) == "mtty-1"
    assert service.reconcile()["unknown"] == []
