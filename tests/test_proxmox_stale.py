"""Issue 24: a lost or late Proxmox post-stop must not block a VF and its licence seat for good.

Replayed in qemu-server's order (tests/qemuserver.py) on a simulated L40S with licences enforced.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hookserver import Server, running_server
from qemuserver import QemuServer

from vgpumgr import licensing
from vgpumgr.service import Service

FIXTURES = Path(__file__).parent / "fixtures/proxmox"
VF4 = "0000:3d:00.4"


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
    yield QemuServer(server, pve)
    svc = Service(server.cfg)
    for a in svc.allocations(live=True):  # leave the module's host clean for the next test
        svc.release(a["pci_address"] or a["uuid"])


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

    late = qm.hook(101, "post-stop")
    assert late.returncode == 0, late.stderr
    assert records(server, "pve-102") == [rec] and qm.vf_type(VF4) == 1148
    assert first["id"] != rec["id"]
    qm.stop(102)
    assert records(server, "pve-102") == [] and qm.vf_type(VF4) == 0
