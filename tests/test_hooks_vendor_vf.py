"""NVIDIA vendor-specific VF vGPUs through the libvirt hook, and the ownership guards on releases.

The hook runs as libvirt runs it (`qemu <domain> <op> <sub-op> <extra>`, domain XML on stdin) against the
real server on a unix socket over a simulated host with a T4 (mdev) and an L40S (vendor VFs); a host reboot
is the simulator's, which clears every mdev and every VF's current_vgpu_type.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hookserver import LIBVIRT, Server, run, running_server
from lxml import etree

from vgpumgr.audit import chain as audit
from vgpumgr.errors import Busy, Conflict
from vgpumgr.fleet.remote import UnixHTTPConnection
from vgpumgr.hostfs.root import Host
from vgpumgr.ops.allocate import Owner
from vgpumgr.placement.placer import Policy
from vgpumgr.service import Service
from vgpumgr.sim.reboot import reboot as sim_reboot
from vgpumgr.virt import domain

T4 = "0000:3b:00.0"
VF1, VF2, VF3, VF4 = "0000:3d:00.4", "0000:3d:00.5", "0000:3d:00.6", "0000:3d:00.7"
L40S = "0000:3d:00.0"
L40S_4Q = "nvidia-1150"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("vfhooks"), "mixed", vfs=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def svc(server: Server) -> Service:
    return Service(server.cfg, licence_mode="warn")


def vf_domain(name: str, vf: str, type_id: str | None = L40S_4Q, managed: bool = False) -> str:
    kind = "passthrough" if managed else "nvidia-vf"
    d = domain.build(domain.VmSpec(name, hostdevs=[domain.Hostdev(kind, address=vf)]))
    if type_id:
        d.set_allocations([{"pci_address": vf, "backend": "nvidia-vf", "type": type_id}])
    return etree.tostring(d.element, encoding="unicode")


def mdev_domain(name: str, uuid: str, parent: str, type_id: str) -> str:
    d = domain.build(domain.VmSpec(name, hostdevs=[domain.Hostdev("mdev", uuid=uuid)]))
    d.set_allocations([{"uuid": uuid, "backend": "mdev", "parent": parent, "type": type_id}])
    return etree.tostring(d.element, encoding="unicode")


def hook(server: Server, dom: str, op: str, sub: str, xml: str, extra: str = "-", **env: str):  # noqa: ANN201
    return run([str(LIBVIRT), dom, op, sub, extra], server.env(**env), xml)


def reboot(root: Path) -> None:
    """A host reboot, then the boot-time step that enables the L40S's VFs again (vgpumgr-restore's first step:
    the driver never re-enables them by itself); their vGPU types stay 0 until a hook sets them."""
    from vgpumgr.backends.sriov import set_numvfs
    from vgpumgr.hostfs.root import Host

    sim_reboot(root)
    set_numvfs(Host(root), L40S, 8, allow_nvidia=True)


def live(svc: Service, vm: str) -> list[dict[str, Any]]:
    return svc.allocations(vm=vm, live=True)


def test_vf_domain_prepare_release_and_reboot(server: Server, svc: Service) -> None:
    xml = vf_domain("vf1", VF1)
    r = hook(server, "vf1", "prepare", "begin", xml)
    assert r.returncode == 0, r.stderr
    assert server.vf_types() == {VF1: L40S_4Q} and "re-created" in r.stdout
    [rec] = live(svc, "vf1")
    assert rec["pci_address"] == VF1 and rec["backend"] == "nvidia-vf"
    for op in ("start", "started"):
        assert hook(server, "vf1", op, "begin", xml).returncode == 0
    reboot(server.root)  # the VF's type reads 0 now; the record stays
    assert server.vf_types() == {}
    r = hook(server, "vf1", "prepare", "begin", xml)
    assert r.returncode == 0, r.stderr
    assert server.vf_types() == {VF1: L40S_4Q} and f"wrote the vGPU type of VF {VF1} again" in r.stdout
    assert [a["id"] for a in live(svc, "vf1")] == [rec["id"]]  # the same record, not a second one
    r = hook(server, "vf1", "prepare", "begin", xml)  # a retried prepare changes nothing
    assert r.returncode == 0 and "again" not in r.stdout
    r = hook(server, "vf1", "release", "end", xml, extra="shutdown")  # libvirt >= 10.5 passes a reason
    assert r.returncode == 0, r.stderr
    assert server.vf_types() == {} and live(svc, "vf1") == [] and f"released vGPU {VF1}" in r.stdout


def test_vf_known_only_from_metadata_is_set_after_a_reboot(server: Server, svc: Service) -> None:
    """No record (a fresh database, or the record was released), the domain's metadata names the type."""
    xml = vf_domain("vf2", VF2)
    reboot(server.root)
    assert live(svc, "vf2") == []
    assert hook(server, "vf2", "prepare", "begin", xml).returncode == 0
    assert server.vf_types() == {VF2: L40S_4Q}
    assert hook(server, "vf2", "release", "end", xml).returncode == 0
    assert server.vf_types() == {}


def test_mdev_domain_before_and_after_a_reboot(server: Server, svc: Service) -> None:
    uuid = "5b8e3a52-7d1e-4b3c-8f1e-2b0d7d5a9c77"
    xml = mdev_domain("md1", uuid, T4, "nvidia-232")
    assert hook(server, "md1", "prepare", "begin", xml).returncode == 0
    assert server.mdevs() == {uuid: (T4, "nvidia-232")}
    reboot(server.root)
    assert server.mdevs() == {}
    r = hook(server, "md1", "prepare", "begin", xml)
    assert r.returncode == 0, r.stderr
    assert server.mdevs() == {uuid: (T4, "nvidia-232")} and len(live(svc, "md1")) == 1
    assert hook(server, "md1", "release", "end", xml).returncode == 0
    assert server.mdevs() == {} and live(svc, "md1") == []


def test_unknown_and_managed_pci_hostdevs_are_left_alone(server: Server, tmp_path: Path) -> None:
    plain = vf_domain("plain", VF3, type_id=None)  # unmanaged, but neither recorded nor described
    r = hook(server, "plain", "prepare", "begin", plain)
    assert r.returncode == 0, r.stderr
    assert server.vf_types() == {}
    managed = vf_domain("whole", "0000:3b:00.0", type_id=None, managed=True)
    down = {"VGPUMGR_SOCKET": str(tmp_path / "none.sock")}
    assert hook(server, "whole", "prepare", "begin", managed, **down).returncode == 0  # vgpumgr not asked


def test_reconnect_never_fails(server: Server, tmp_path: Path) -> None:
    xml = vf_domain("rc1", VF4)
    for env in ({}, {"VGPUMGR_SOCKET": str(tmp_path / "none.sock")}, {"VGPUMGR_TOKEN": "vgm_wrong"}):
        r = hook(server, "rc1", "reconnect", "begin", xml, **env)
        assert r.returncode == 0, r.stderr
    assert "service is not running" in r.stderr or "(401)" in r.stderr
    r = hook(server, "rc1", "reconnect", "begin", "<domain><devices><hostdev")  # cut-off XML
    assert r.returncode == 0 and "ignored: the domain keeps running" in r.stderr
    r = hook(server, "rc1", "prepare", "begin", "<domain><devices><hostdev")
    assert r.returncode == 1 and "cannot be parsed" in r.stderr
    assert server.vf_types() == {}


# -- ownership guards -----------------------------------------------------------------------------------
def rest(server: Server, method: str, path: str) -> tuple[int, dict[str, Any]]:
    conn = UnixHTTPConnection(str(server.sock))
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {server.token}"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def refused_events(svc: Service, vf: str) -> list[dict[str, Any]]:
    with svc.sessions() as s:
        return [audit.to_dict(e) for e in audit.query(s, vgpu=vf, action=audit.VGPU_REMOVE, outcome="failed")
                if (e.detail or {}).get("refused") == "owner mismatch"]


def test_a_late_release_of_vm_a_leaves_vm_bs_vgpu(server: Server, svc: Service) -> None:
    a = svc.allocate(L40S_4Q, vm="race-a", policy=Policy(pin_parent=VF3))
    owner_a = Owner("race-a", allocation_id=a["id"])
    svc.release(VF3, owner=owner_a)  # A stops: its release goes through
    b = svc.allocate(L40S_4Q, vm="race-b", policy=Policy(pin_parent=VF3))  # the VF goes to B
    assert server.vf_types() == {VF3: L40S_4Q}
    # A's release arrives again (a retry, a late hook): through the service, REST, and the hook itself
    with pytest.raises(Conflict, match="now belongs to VM race-b"):
        svc.release(VF3, owner=owner_a)
    status, body = rest(server, "DELETE", f"/v1/vgpus/{VF3}?vm=race-a&allocation_id={a['id']}")
    assert status == 409 and "race-b" in body["detail"]
    r = hook(server, "race-a", "release", "end", vf_domain("race-a", VF3))
    assert r.returncode == 0, r.stderr
    assert server.vf_types() == {VF3: L40S_4Q}
    assert [x["id"] for x in live(svc, "race-b")] == [b["id"]]
    refused = refused_events(svc, VF3)
    assert len(refused) == 2 and refused[0]["vm"] == "race-a"
    assert refused[0]["detail"]["holder"] == {"vm": "race-b", "allocation_id": b["id"]}
    # a hook token must name the owner; the right owner releases B
    assert rest(server, "DELETE", f"/v1/vgpus/{VF3}")[0] == 400
    status, body = rest(server, "DELETE", f"/v1/vgpus/{VF3}?vm=race-b&allocation_id={b['id']}")
    assert status == 200 and body["state"] == "released" and server.vf_types() == {}


def test_an_owner_must_name_the_allocation() -> None:
    with pytest.raises(Exception, match="allocation id or idempotency key"):
        Owner("vm-x")
    assert Owner("vm-x", idempotency_key="k1").as_dict() == {"vm": "vm-x", "idempotency_key": "k1"}


def _hold(root: Path, target: str, pid: int) -> Path:
    fd = root / "proc" / str(pid) / "fd"
    fd.mkdir(parents=True)
    (fd.parent / "comm").write_text("qemu-system-x86\n")
    os.symlink(target, fd / "21")
    return fd.parent


def test_a_vf_held_open_is_never_cleared(server: Server, svc: Service) -> None:
    import shutil

    a = svc.allocate(L40S_4Q, vm="held", policy=Policy(pin_parent=VF4))
    owner = Owner("held", allocation_id=a["id"])
    host = Host(server.root)
    group = os.path.basename(os.readlink(host.pci(VF4) / "iommu_group"))
    proc = _hold(server.root, f"/dev/vfio/{group}", 4711)
    with pytest.raises(Busy, match=r"qemu-system-x86\[4711\]"):
        svc.release(VF4, owner=owner)
    shutil.rmtree(proc)
    vfio_dev = host.pci(VF4).resolve() / "vfio-dev/vfio7"  # iommufd: QEMU holds the VF's cdev instead
    vfio_dev.mkdir(parents=True)
    proc = _hold(server.root, "/dev/vfio/devices/vfio7", 4712)
    with pytest.raises(Busy, match=r"\[4712\]"):
        svc.release(VF4, owner=owner)
    assert server.vf_types() == {VF4: L40S_4Q} and len(live(svc, "held")) == 1
    shutil.rmtree(proc)
    shutil.rmtree(vfio_dev.parent)
    svc.release(VF4, owner=owner)
    assert server.vf_types() == {}


def test_an_admin_release_without_owner_is_audited_as_such(server: Server, svc: Service) -> None:
    svc.allocate(L40S_4Q, vm="adm", policy=Policy(pin_parent=VF1))
    svc.release(VF1)
    with svc.sessions() as s:
        ev = audit.query(s, vgpu=VF1, action=audit.VGPU_REMOVE, outcome="ok", newest_first=True, limit=1)[0]
    assert ev.detail["owner"] == "admin (none named)"
