"""The Proxmox hookscript run as qemu-server runs it, for the three kinds of config: a legacy mdev card, a
single NVIDIA vendor-specific VF, and a resource mapping of several VFs.

`QemuServer` (tests/qemuserver.py) replays what qemu-server 8.2.5+ does around the hook phases.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hookserver import PROXMOX, Server, run, running_server
from qemuserver import QemuServer

from vgpumgr.licensing import seats as licensing
from vgpumgr.service import Service

FIXTURES = Path(__file__).parent / "fixtures/proxmox"
T4 = "0000:3b:00.0"
VF4, VF5, VF6 = "0000:3d:00.4", "0000:3d:00.5", "0000:3d:00.6"
MAPPING = [VF4, VF5, VF6]  # pve1's devices in fixtures/proxmox/pci.cfg, in order


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("pve"), "mixed", vfs=4, licence_mode="enforce") as srv:
        svc = Service(srv.cfg)
        with svc.tx() as s:  # two vWS seats: Q-series vGPUs of two VMs
            licensing.add_pool(s, name="ws", edition_name="vWS", seats=2)
        yield srv


@pytest.fixture
def qm(server: Server, tmp_path: Path) -> QemuServer:
    pve = tmp_path / "etc-pve"
    (pve / "mapping").mkdir(parents=True)
    (pve / "qemu-server").mkdir()
    shutil.copy(FIXTURES / "pci.cfg", pve / "mapping/pci.cfg")
    for conf in FIXTURES.glob("*.conf"):
        shutil.copy(conf, pve / "qemu-server" / f"{conf.name.split('-')[0]}.conf")
    return QemuServer(server, pve)


def records(server: Server, vm: str) -> list[dict[str, Any]]:
    return Service(server.cfg).allocations(vm=vm, live=True)


def test_legacy_mdev_card_keeps_proxmox_uuid_scheme(server: Server, qm: QemuServer) -> None:
    uuid = "00000000-0000-0000-0000-000000000101"
    assert qm.start(101, [T4], "nvidia-232")
    assert server.mdevs() == {uuid: (T4, "nvidia-232")}
    [rec] = records(server, "pve-101")
    assert rec["uuid"] == uuid and rec["licence"] == "vWS"
    qm.stop(101, legacy_uuid=uuid)
    assert qm.log == ["101 hook pre-start -> 0", f"101 reuse mdev {uuid}", "101 qemu started",
                      "101 hook post-start -> 0", "101 qemu exited", f"101 cleanup remove mdev {uuid}",
                      "101 hook post-stop -> 0"]
    assert server.mdevs() == {} and records(server, "pve-101") == []


def test_vendor_vfs_single_and_mapping_with_seats_and_a_late_post_stop(server: Server, qm: QemuServer) -> None:
    before = server.vf_types()
    assert qm.start(102, [VF4], "nvidia-1150")  # hostpci0: 0000:3d:00.4,mdev=nvidia-1150
    assert qm.log[:5] == ["102 hook pre-start -> 0", f"102 reserve {VF4}", f"102 write 0 {VF4}",
                          f"102 write 1150 {VF4}", "102 qemu started"]
    assert qm.log[5] == "102 hook post-start -> 0"
    [rec] = records(server, "pve-102")
    assert rec["pci_address"] == VF4 and rec["licence"] == "vWS" and rec["type"] == "nvidia-1150"

    assert qm.start(103, MAPPING, "nvidia-1150")  # mapping=l40s-vgpu: VF4 is taken, Proxmox picks VF5
    assert f"103 reserve {VF5}" in qm.log and [r["pci_address"] for r in records(server, "pve-103")] == [VF5]

    (qm.pve / "qemu-server/104.conf").write_text(f"name: third\nhostpci0: {VF6},mdev=nvidia-1150,pcie=1\n")
    r = run([str(PROXMOX), "104", "pre-start"], qm.env())
    assert r.returncode == 1 and "licence seat" in r.stderr and "pve-104" in r.stderr  # the veto, with why
    assert not qm.start(104, [VF6], "nvidia-1150") and qm.log[-1] == "104 start aborted"
    assert qm.vf_type(VF6) == 0 and VF6 not in qm.reserved()  # Proxmox never got to write a type

    qm.stop(102)  # cleanup writes 0 before post-stop; the record and the seat go
    assert qm.log[-3:] == ["102 qemu exited", f"102 cleanup write 0 {VF4}", "102 hook post-stop -> 0"]
    assert records(server, "pve-102") == [] and qm.vf_type(VF4) == 0
    assert qm.start(104, [VF6], "nvidia-1150")  # the seat is free again

    # VM 105 gets VF4 after 102; then 102's post-stop runs once more (qmeventd's `qm cleanup`, a retry)
    qm.stop(103)
    (qm.pve / "qemu-server/105.conf").write_text(f"hostpci0: {VF4},mdev=nvidia-1150\n")
    assert qm.start(105, [VF4], "nvidia-1150")
    assert qm.hook(102, "post-stop").returncode == 0
    assert [r["pci_address"] for r in records(server, "pve-105")] == [VF4] and qm.vf_type(VF4) == 1150
    for vmid in (104, 105):
        qm.stop(vmid)
    assert server.vf_types() == before


def test_post_start_without_a_reservation_takes_the_vf_that_holds_the_type(server: Server, qm: QemuServer) -> None:
    (qm.pve / "qemu-server/106.conf").write_text("hostpci0: mapping=l40s-vgpu,mdev=nvidia-1150\n")
    assert qm.hook(106, "pre-start").returncode == 0
    qm.set_vf(106, VF5, 1150)  # no reservations file at all
    r = qm.hook(106, "post-start")
    assert r.returncode == 0 and f"recorded VF {VF5}" in r.stdout
    assert [x["pci_address"] for x in records(server, "pve-106")] == [VF5]
    qm.stop(106)
    qm.host.write(qm.host.pci(VF5) / "nvidia/current_vgpu_type", "0")
    assert records(server, "pve-106") == []


def test_a_start_after_a_host_crash_finds_no_stale_record_in_its_way(server: Server, qm: QemuServer) -> None:
    assert qm.start(102, [VF4], "nvidia-1150")
    first = records(server, "pve-102")
    qm.stop(102, post_stop=False)  # the host went down: Proxmox's cleanup ran at boot, post-stop never did
    assert records(server, "pve-102") == first
    assert qm.start(102, [VF4], "nvidia-1150")
    [rec] = records(server, "pve-102")
    assert rec["pci_address"] == VF4 and rec["id"] != first[0]["id"]
    qm.stop(102)
    assert records(server, "pve-102") == [] and server.vf_types() == {}


def test_bad_paths_mappings_and_configs_are_refused_clearly(server: Server, qm: QemuServer) -> None:
    r = run([str(PROXMOX), "102", "pre-start"], qm.env(VGPUMGR_PVE_CONF_DIR="etc/pve/qemu-server"))
    assert r.returncode == 1 and "VGPUMGR_PVE_CONF_DIR" in r.stderr and "absolute" in r.stderr
    r = run([str(PROXMOX), "102", "pre-start"], qm.env(VGPUMGR_SYSFS_ROOT="/sys/../tmp"))
    assert r.returncode == 1 and "VGPUMGR_SYSFS_ROOT" in r.stderr
    r = run([str(PROXMOX), "103", "pre-start"], qm.env(VGPUMGR_PVE_NODE="pve3"))
    assert r.returncode == 1 and "no device on node pve3" in r.stderr
    (qm.pve / "qemu-server/107.conf").write_text("hostpci0: mapping=nope,mdev=nvidia-1150\n")
    r = run([str(PROXMOX), "107", "pre-start"], qm.env())
    assert r.returncode == 1 and "mapping 'nope' is not in" in r.stderr
    (qm.pve / "qemu-server/108.conf").write_text("hostpci0: 3d:00,mdev=nvidia-1150\n")  # all functions
    r = run([str(PROXMOX), "108", "pre-start"], qm.env())
    assert r.returncode == 1 and "single PCI functions" in r.stderr
    assert server.vf_types() == {}


def test_reconcile_and_restore_never_write_a_type_that_proxmox_owns(server: Server, qm: QemuServer) -> None:
    (qm.pve / "qemu-server/107.conf").write_text(f"hostpci0: {VF4},mdev=nvidia-1150\n")
    assert qm.start(107, [VF4], "nvidia-1150")
    [rec] = records(server, "pve-107")
    assert rec["kernel_owner"] == "proxmox"
    qm.stop(107, post_stop=False)  # QEMU gone and the type cleared, but no post-stop ran (a crash)
    report = Service(server.cfg).reconcile(fix=True)
    assert VF4 not in report["missing"] and VF4 not in report["restored"]
    assert qm.vf_type(VF4) == 0  # Proxmox writes it at the VM's next start; vgpumgr keeps out
    Service(server.cfg).restore()
    assert qm.vf_type(VF4) == 0  # the boot-time restore keeps out too
    assert qm.hook(107, "post-stop").returncode == 0
    assert records(server, "pve-107") == []


def test_pre_start_refreshes_the_licence_token_copy_and_names_the_args_line(server: Server, qm: QemuServer) -> None:
    """Proxmox gives QEMU fw_cfg only through root's `args:`: pre-start writes the VM's token copy and prints the
    line to add until the VM's config has it."""
    import os

    from vgpumgr.licensing import token as licence_token

    token = b"eyJhbGciOiJSUzI1NiJ9.e30." + os.urandom(16).hex().encode()
    licence_token.store(server.cfg.state_dir, token)
    try:
        conf = qm.pve / "qemu-server/106.conf"
        conf.write_text(f"hostpci0: {VF6},mdev=nvidia-1150\n")
        r = qm.hook(106, "pre-start")
        assert r.returncode == 0, r.stderr
        copy = licence_token.fwcfg_path(server.cfg.state_dir, "pve-106")
        args = f"-fw_cfg name=opt/dev.vgpumgr/nls/ft1/client_configuration_token,file={copy}"
        assert f"args: {args}" in r.stdout and copy.read_bytes() == token
        assert token.decode() not in r.stdout + r.stderr
        conf.write_text(conf.read_text() + f"args: {args}\n")
        r = qm.hook(106, "pre-start")
        assert r.returncode == 0 and "args:" not in r.stdout
    finally:
        licence_token.remove(server.cfg.state_dir)
