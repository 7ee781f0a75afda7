"""Issue 24: a lost or late Proxmox post-stop must not block a VF and its licence seat for good.

Replayed in qemu-server's order (tests/qemuserver.py) on a simulated L40S with licences enforced.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hookserver import Server, running_server
from qemuserver import QemuServer
from simhost import run as cli

from vgpumgr.audit import chain as audit
from vgpumgr.licensing import seats as licensing
from vgpumgr.ops import stale
from vgpumgr.service import Service

FIXTURES = Path(__file__).parent / "fixtures/proxmox"
VF4, VF5 = "0000:3d:00.4", "0000:3d:00.5"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("pve-stale"), "mixed", vfs=4, licence_mode="enforce") as srv:
        with Service(srv.cfg).tx() as s:
            licensing.add_pool(s, name="ws", edition_name="vWS", seats=2)
        yield srv


@pytest.fixture
def qm(server: Server, tmp_path: Path) -> Iterator[QemuServer]:
    pve = tmp_path / "etc-pve"
    (pve / "mapping").mkdir(parents=True)
    (pve / "qemu-server").mkdir()
    shutil.copy(FIXTURES / "pci.cfg", pve / "mapping/pci.cfg")
    for vmid in (101, 102, 103):
        (pve / f"qemu-server/{vmid}.conf").write_text(f"name: vm{vmid}\nhostpci0: {VF4},mdev=nvidia-1148\n")
    qm = QemuServer(server, pve)
    yield qm
    svc = Service(server.cfg)  # leave the module's host clean for the next test
    for a in svc.allocations(live=True):
        svc.release(a["pci_address"] or a["uuid"])
    for p in qm.host.proc.iterdir():
        if p.name.isdigit():  # the simulated processes; /proc/modules, cpuinfo and cmdline stay
            shutil.rmtree(p)
    for vf in server.vf_types():
        qm.host.write(qm.host.pci(vf) / "nvidia/current_vgpu_type", "0")


def records(server: Server, vm: str) -> list[dict[str, Any]]:
    return Service(server.cfg).allocations(vm=vm, live=True)


def test_a_delayed_post_stop_lets_the_next_vm_start_and_then_leaves_it_alone(server: Server, qm: QemuServer) -> None:
    assert qm.start(101, [VF4], "nvidia-1148")
    [first] = records(server, "pve-101")
    qm.stop(101, post_stop=False)  # cleanup wrote 0 and dropped the reservation; post-stop is late
    assert qm.vf_type(VF4) == 0 and qm.reserved() == {}

    assert qm.start(102, [VF4], "nvidia-1148"), qm.log
    assert qm.log[-6:] == ["102 hook pre-start -> 0", f"102 reserve {VF4}", f"102 write 0 {VF4}",
                           f"102 write 1148 {VF4}", "102 qemu started", "102 hook post-start -> 0"]
    [rec] = records(server, "pve-102")
    assert rec["pci_address"] == VF4 and rec["licence"] == "vWS"
    assert records(server, "pve-101") == []
    [(_, outcome, actor, detail)] = stale_events(server, first)
    assert outcome == "ok" and actor == "token:hook" and detail["evidence"]["qemu"].startswith("no QEMU pid file")
    assert "released the stale record of pve-101 on VF 0000:3d:00.4" in qm.answers[(102, "pre-start")].stdout

    late = qm.hook(101, "post-stop")
    assert late.returncode == 0, late.stderr
    assert records(server, "pve-102") == [rec] and qm.vf_type(VF4) == 1148
    assert first["id"] != rec["id"]
    qm.stop(102)
    assert records(server, "pve-102") == [] and qm.vf_type(VF4) == 0


# -- helpers ------------------------------------------------------------------------------------------

def seats_used(server: Server) -> int:
    with Service(server.cfg).sessions() as s:
        return sum(e.used for e in licensing.usage(s))


def stale_events(server: Server, rec: dict[str, Any]) -> list[Any]:
    """The vgpu.release-stale events of the record `rec` (the module's host outlives each test)."""
    with Service(server.cfg).sessions() as s:
        events = audit.query(s, vm=rec["vm"], action=stale.RELEASE_STALE)
        return [(e.action, e.outcome, e.actor, e.detail) for e in events
                if (e.detail or {}).get("allocation_id") == rec["id"]]


def reconcile(server: Server, *extra: str) -> tuple[int, dict[str, Any]]:
    rc, out, err = cli("reconcile", "--sysfs-root", str(server.root), "--state-dir", str(server.cfg.state_dir),
                       "--json", *extra)
    assert not err, err
    return rc, json.loads(out)


def pre_start_refused(qm: QemuServer, vmid: int) -> str:
    r = qm.hook(vmid, "pre-start")
    assert r.returncode == 1, r.stdout
    return r.stderr


# -- a lost post-stop ---------------------------------------------------------------------------------

def test_a_lost_post_stop_is_reported_and_fixed_with_its_seat(server: Server, qm: QemuServer) -> None:
    assert qm.start(101, [VF4], "nvidia-1148")
    [rec] = records(server, "pve-101")
    assert seats_used(server) == 1
    rc, r = reconcile(server)
    assert rc == 0 and r["stale_records"] == []  # running: nothing to say
    qm.stop(101, post_stop=False)  # the hook timed out: nobody will call it again

    rc, r = reconcile(server)
    assert rc == 10 and r["missing"] == [] and r["unknown"] == []
    [st] = r["stale_records"]
    assert (st["vgpu"], st["vm"], st["kind"], st["type"], st["id"]) == (VF4, "pve-101", "proxmox", "nvidia-1148",
                                                                       rec["id"])
    assert st["evidence"] == {"vmid": 101, "qemu": f"no QEMU pid file {qm.pidfile(101)}", "vf_type": 0,
                              "reservation": None, "holders": []}
    rc, text, _ = cli("reconcile", "--sysfs-root", str(server.root), "--state-dir", str(server.cfg.state_dir))
    assert rc == 10
    assert "stale records (VM gone, its release never came): 1\n" in text
    assert f"  {VF4}  nvidia-1148 for VM pve-101 (proxmox)\n" in text and "VF type 0; reservation: none" in text
    assert records(server, "pve-101") == [rec] and seats_used(server) == 1  # reporting changes nothing

    rc, r = reconcile(server, "--fix")
    assert rc == 0 and [(x["vgpu"], x["action"], x["licence_returned"]) for x in r["stale_records"]] == [
        (VF4, "released", "vWS")]
    assert records(server, "pve-101") == [] and seats_used(server) == 0 and qm.vf_type(VF4) == 0
    [(action, outcome, actor, detail)] = stale_events(server, rec)
    assert (action, outcome) == ("vgpu.release-stale", "ok") and actor.startswith("cli:")
    assert detail["evidence"]["qemu"].startswith("no QEMU pid file") and detail["licence_returned"] == "vWS"
    assert reconcile(server)[0] == 0
    assert qm.hook(101, "post-stop").returncode == 0  # should it come after all: nothing left to do

def test_a_lost_post_stop_of_a_legacy_mdev_card_frees_its_record_and_seat(server: Server, qm: QemuServer) -> None:
    t4, uuid = "0000:3b:00.0", "00000000-0000-0000-0000-000000000104"
    (qm.pve / "qemu-server/104.conf").write_text(f"name: vm104\nhostpci0: {t4},mdev=nvidia-232\n")
    assert qm.start(104, [t4], "nvidia-232")
    [rec] = records(server, "pve-104")
    assert reconcile(server)[1]["stale_records"] == []  # its QEMU runs
    qm.stop(104, legacy_uuid=uuid, post_stop=False)  # qemu-server removed the mdev; the post-stop never came

    rc, r = reconcile(server)
    assert rc == 10 and r["missing"] == []  # not "missing": its mdev must not be made again
    [st] = r["stale_records"]
    assert (st["vgpu"], st["vm"], st["kind"], st["backend"], st["id"]) == (uuid, "pve-104", "proxmox", "mdev",
                                                                           rec["id"])
    assert st["evidence"] == {"vmid": 104, "qemu": f"no QEMU pid file {qm.pidfile(104)}", "mdev": "gone"}
    rc, text, _ = cli("reconcile", "--sysfs-root", str(server.root), "--state-dir", str(server.cfg.state_dir))
    assert rc == 10 and f"  {uuid}  nvidia-232 for VM pve-104 (proxmox)\n" in text and "; mdev gone" in text

    rc, r = reconcile(server, "--fix")
    assert [(x["vgpu"], x["action"], x["licence_returned"]) for x in r["stale_records"]] == [(uuid, "released", "vWS")]
    assert records(server, "pve-104") == [] and seats_used(server) == 0 and server.mdevs() == {}
    assert qm.start(104, [t4], "nvidia-232")  # and the VM starts again as it always did
    assert [a["uuid"] for a in records(server, "pve-104")] == [uuid]
    qm.stop(104, legacy_uuid=uuid)


def test_the_next_legacy_card_start_releases_what_a_lost_post_stop_left_on_a_full_gpu(
        server: Server, qm: QemuServer) -> None:
    t4, gone, new = "0000:3b:00.0", "00000000-0000-0000-0000-000000000106", "00000000-0000-0000-0000-000000000107"
    for vmid in (106, 107):  # T4-16Q: the whole T4, one per GPU
        (qm.pve / f"qemu-server/{vmid}.conf").write_text(f"name: vm{vmid}\nhostpci0: {t4},mdev=nvidia-234\n")
    assert qm.start(106, [t4], "nvidia-234")
    qm.stop(106, legacy_uuid=gone, post_stop=False)
    assert qm.start(107, [t4], "nvidia-234")  # pre-start found the GPU full, released 106's record, went on
    assert records(server, "pve-106") == [] and [a["uuid"] for a in records(server, "pve-107")] == [new]
    assert seats_used(server) == 1
    qm.stop(107, legacy_uuid=new)


def test_a_legacy_mdev_that_is_still_there_or_still_used_is_never_released(server: Server, qm: QemuServer) -> None:
    t4, uuid = "0000:3b:00.0", "00000000-0000-0000-0000-000000000105"
    (qm.pve / "qemu-server/105.conf").write_text(f"name: vm105\nhostpci0: {t4},mdev=nvidia-232\n")
    assert qm.start(105, [t4], "nvidia-232")
    qm.exit_qemu(105)  # QEMU gone, but the mdev stays (no cleanup yet, or a start about to use it)
    qm.pidfile(105).unlink(missing_ok=True)
    rc, r = reconcile(server, "--fix")
    assert r["stale_records"] == [] and [a["uuid"] for a in records(server, "pve-105")] == [uuid]
    assert uuid in server.mdevs()
    qm.stop(105, legacy_uuid=uuid)



def test_a_service_restart_between_stop_and_post_stop(server: Server, qm: QemuServer) -> None:
    assert qm.start(101, [VF4], "nvidia-1148")
    [rec] = records(server, "pve-101")
    server.stop_service()
    try:
        qm.stop(101)  # post-stop finds no service and fails; Proxmox goes on
        assert qm.log[-1] == "101 hook post-stop -> 1"
    finally:
        server.start_service()
    assert records(server, "pve-101") == [] and seats_used(server) == 0  # released by the service's start
    [(_, outcome, actor, detail)] = stale_events(server, rec)
    assert outcome == "ok" and actor == "vgpumgr:start" and detail["evidence"]["vf_type"] == 0
    assert qm.start(102, [VF4], "nvidia-1148")
    assert qm.hook(101, "post-stop").returncode == 0  # Proxmox's retry, late: 102 keeps its VF
    assert [r["pci_address"] for r in records(server, "pve-102")] == [VF4] and qm.vf_type(VF4) == 1148
    qm.stop(102)


# -- what is never released -------------------------------------------------------------------------

def _runs(qm: QemuServer) -> None:
    """QEMU of 101 still runs (its pid file and command line say so), though nothing else shows it."""
    pid = qm.qemu[101]
    (qm.host.proc / str(pid) / "fd/23").unlink()
    qm.host.write(qm.host.pci(VF4) / "nvidia/current_vgpu_type", "0")
    qm.write_reservations({})


def _typed(qm: QemuServer) -> None:
    """QEMU exited but cleanup could not write 0 ("could not cleanup nvidia vgpu")."""
    qm.exit_qemu(101)
    qm.pidfile(101).unlink()
    qm.write_reservations({})


def _reserved_for_another_vm(qm: QemuServer) -> None:
    """101 is gone; Proxmox has just reserved the VF for 103 and not yet written its type."""
    qm.stop(101, post_stop=False)
    qm.reserve(VF4, 103, f"time:{int(time.time()) + 30}")


def _reserved_by_a_running_vm(qm: QemuServer) -> None:
    qm.stop(101, post_stop=False)
    pid = qm.process(qm.qemu_argv(103, VF4))
    qm.pidfile(103).write_text(f"{pid}\n")
    qm.reserve(VF4, 103, f"pid:{pid}")


def _held(qm: QemuServer) -> None:
    """101 is gone, but some process still has the VF's VFIO group open."""
    qm.stop(101, post_stop=False)
    qm.process(["/usr/bin/some-tool"], holds=VF4)


def _pid_file_unreadable(qm: QemuServer) -> None:
    qm.stop(101, post_stop=False)
    qm.pidfile(101).mkdir()  # reading it fails: whether QEMU runs cannot be told


@pytest.mark.parametrize("guard", [_runs, _typed, _reserved_for_another_vm, _reserved_by_a_running_vm, _held,
                                   _pid_file_unreadable])
def test_a_record_whose_vm_runs_or_whose_vf_is_typed_reserved_or_held_is_never_released(
        server: Server, qm: QemuServer, guard: Any) -> None:
    assert qm.start(101, [VF4], "nvidia-1148")
    [rec] = records(server, "pve-101")
    guard(qm)
    type_before, reserved_before = qm.vf_type(VF4), qm.reserved_lines()
    assert "already holds a vGPU" in pre_start_refused(qm, 102)
    assert reconcile(server)[1]["stale_records"] == []
    assert reconcile(server, "--fix")[1]["stale_records"] == []
    server.stop_service()
    server.start_service()
    assert records(server, "pve-101") == [rec] and seats_used(server) == 1
    assert qm.vf_type(VF4) == type_before and qm.reserved_lines() == reserved_before
    assert stale_events(server, rec) == []


# -- Proxmox's own tests of "running" and "reserved" --------------------------------------------------

def _pid_reused(qm: QemuServer) -> None:
    """The pid file outlived QEMU (a crash) and its pid now belongs to another program."""
    qm.exit_qemu(101)
    qm.process(["/usr/bin/sleep", "600"], pid=int(qm.pidfile(101).read_text()))


def _pid_reused_by_another_qemu(qm: QemuServer) -> None:
    qm.exit_qemu(101)
    qm.process(qm.qemu_argv(104, VF5), pid=int(qm.pidfile(101).read_text()))


def _zombie(qm: QemuServer) -> None:
    pid = qm.qemu[101]
    shutil.rmtree(qm.host.proc / str(pid))
    qm.process(qm.qemu_argv(101, VF4), state="Z", pid=pid)


def _reservation_expired(qm: QemuServer) -> None:
    qm.reserve(VF4, 103, f"time:{int(time.time()) - 1}")  # qemu-server takes such a leftover over itself


@pytest.mark.parametrize("leftover", [_pid_reused, _pid_reused_by_another_qemu, _zombie, _reservation_expired])
def test_what_qemu_server_itself_counts_as_not_running_or_not_reserved(
        server: Server, qm: QemuServer, leftover: Any) -> None:
    assert qm.start(101, [VF4], "nvidia-1148")
    [rec] = records(server, "pve-101")
    qm.stop(101, post_stop=False)
    if leftover is not _reservation_expired:  # a crash: the pid file stays (QEMU could not remove it)
        pid = qm.process(qm.qemu_argv(101, VF4))
        qm.pidfile(101).write_text(f"{pid}\n")
        qm.qemu[101] = pid
    leftover(qm)
    assert qm.start(102, [VF4], "nvidia-1148"), qm.log
    [(_, outcome, _, detail)] = stale_events(server, rec)
    assert outcome == "ok" and detail["evidence"]["vf_type"] == 0 and detail["evidence"]["holders"] == []
    assert records(server, "pve-101") == [] and len(records(server, "pve-102")) == 1
    qm.stop(102)
