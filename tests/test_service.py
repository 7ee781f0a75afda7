"""The service: place -> reserve -> create -> activate, or roll back; VMs; reconcile; MIG-backed vGPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpumgr.audit import chain as audit
from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.config import Config
from vgpumgr.discovery.mdev import discover_mdevs
from vgpumgr.discovery.nvidia_vf import discover_vf_vgpus
from vgpumgr.errors import Busy, Conflict, InvalidInput, KernelError, NoCapacity, NoSeat, NotFound, VgpuError
from vgpumgr.placement.placer import Policy
from vgpumgr.service import Service
from vgpumgr.sim import profiles
from vgpumgr.virt.domain import read_allocations


def make_service(tmp_path: Path, profile: str = "mixed", licence_mode: str = "off", **kw: object) -> Service:
    root = profiles.create(tmp_path / "sim", profile, **kw)
    cfg = Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "state"), connect="test:///default")
    return Service(cfg, licence_mode=licence_mode)


def events(svc: Service, **kw: object) -> list[tuple[str, str]]:
    with svc.sessions() as s:
        return [(e.action, e.outcome) for e in audit.query(s, **kw)]


def test_allocate_and_release_mdev_records_and_audits(tmp_path: Path) -> None:
    svc = make_service(tmp_path)
    a = svc.allocate("T4-4Q", vm="web1")
    assert (a["backend"], a["parent"], a["type"], a["state"], a["vm"]) == ("mdev", "0000:3b:00.0", "nvidia-232",
                                                                         "active", "web1")
    assert [m.uuid for m in discover_mdevs(svc.host)] == [a["uuid"]]
    assert events(svc, vgpu=a["uuid"]) == [("placement", "ok"), ("vgpu.create", "ok")]
    r = svc.release(a["uuid"])
    assert r["state"] == "released" and discover_mdevs(svc.host) == []
    assert events(svc, vgpu=a["uuid"])[-1] == ("vgpu.remove", "ok")
    with pytest.raises(NotFound):
        svc.release(a["uuid"])


def test_allocate_vendor_vf_and_one_vgpu_per_gpu_per_vm(tmp_path: Path) -> None:
    svc = make_service(tmp_path)
    a = svc.allocate("L40S-2Q", vm="web1")
    assert a["backend"] == "nvidia-vf" and a["pci_address"] == "0000:3d:00.4" and a["gpu"] == "0000:3d:00.0"
    assert [v.address for v in discover_vf_vgpus(svc.host)] == ["0000:3d:00.4"]
    with pytest.raises(NoCapacity, match="already has a vGPU on this GPU"):
        svc.allocate("L40S-2Q", vm="web1")
    b = svc.allocate("L40S-2Q", vm="web2")
    assert b["pci_address"] == "0000:3d:00.5"
    with pytest.raises(NoCapacity, match="2048 MB"):  # equal-size mode
        svc.allocate("L40S-4Q", vm="web3")
    svc.release(a["pci_address"])
    svc.release(b["pci_address"])
    assert svc.allocate("L40S-4Q", vm="web3")["type"] == "nvidia-1150"


def test_idempotency_key_gives_the_same_vgpu(tmp_path: Path) -> None:
    svc = make_service(tmp_path)
    a = svc.allocate("T4-2Q", vm="vm1", idempotency_key="hook-1")
    assert svc.allocate("T4-2Q", vm="vm1", idempotency_key="hook-1") == a
    assert len(discover_mdevs(svc.host)) == 1
    svc.release(a["uuid"])
    with pytest.raises(Conflict, match="released"):
        svc.allocate("T4-2Q", vm="vm1", idempotency_key="hook-1")


def test_failed_device_creation_rolls_back_record_seat_and_is_audited(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    svc = make_service(tmp_path, licence_mode="enforce")
    from vgpumgr.licensing import seats as licensing

    with svc.tx() as s:
        licensing.add_pool(s, name="p", edition_name="vWS", seats=1)

    def boom(*a: object, **k: object) -> None:
        raise KernelError("creating mdev failed: Input/output error (EIO)", hint="check dmesg")

    monkeypatch.setattr(mdev_backend, "create", boom)
    with pytest.raises(KernelError):
        svc.allocate("T4-4Q", vm="web1")
    assert svc.allocations(live=True) == []
    [rec] = svc.allocations()
    assert rec["state"] == "released"
    assert events(svc, vm="web1")[-1] == ("vgpu.create", "failed")
    with svc.sessions() as s:
        assert [u.used for u in licensing.usage(s)] == [0]  # the seat came back
    monkeypatch.undo()
    assert svc.allocate("T4-4Q", vm="web1")["licence"] == "vWS"


def test_licence_enforce_and_warn(tmp_path: Path) -> None:
    svc = make_service(tmp_path, licence_mode="enforce")
    with pytest.raises(NoSeat, match="no free vWS licence seat"):
        svc.allocate("T4-4Q", vm="web1")
    assert discover_mdevs(svc.host) == [] and svc.allocations() == []
    warn = Service(svc.cfg, licence_mode="warn")
    a = warn.allocate("T4-4Q", vm="web1")
    assert a["licence"] is None
    assert ("licence.acquire", "warning") in events(warn, vm="web1")


def test_no_capacity_is_audited_with_reasons(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "t4")
    svc.allocate("T4-16Q", vm="big")
    with pytest.raises(NoCapacity) as e:
        svc.allocate("T4-1Q", vm="small")
    assert "equal-size" in str(e.value) or "16384" in str(e.value)
    assert events(svc)[-1] == ("placement", "failed")


def test_pinning_and_policy_validation(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "a40-sriov", vfs=4)
    a = svc.allocate("A40-2Q", vm="x", policy=Policy(pin_parent="0000:41:00.6"))
    assert a["parent"] == "0000:41:00.6"
    with pytest.raises(InvalidInput):
        Policy(pin_gpu="../../etc")
    with pytest.raises(InvalidInput):
        svc.allocate("A40-2Q", vm="bad<name>")


def test_release_refuses_a_device_held_by_a_process(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "t4")
    a = svc.allocate("T4-4Q")
    group = mdev_backend.get(svc.host, a["uuid"]).iommu_group
    fd = svc.host.proc / "99" / "fd"
    fd.mkdir(parents=True)
    (svc.host.proc / "99" / "comm").write_text("qemu-system-x86\n")
    (fd / "7").symlink_to(f"/dev/vfio/{group}")
    with pytest.raises(Busy, match=r"qemu-system-x86\[99\]"):
        svc.release(a["uuid"])
    assert svc.find_allocation(a["uuid"])["state"] == "active"
    assert events(svc)[-1] == ("vgpu.remove", "failed")


# -- VMs ---------------------------------------------------------------------------------------------

def test_vm_create_start_delete(tmp_path: Path) -> None:
    svc = make_service(tmp_path)
    res = svc.create_vm("web1", vgpus=["T4-4Q", "L40S-2Q"], display=True, start=True, memory_mib=2048)
    assert res["state"] == "running" and len(res["allocations"]) == 2
    xml = svc.vm_xml("web1")
    mdev_uuid = res["allocations"][0]["uuid"]
    assert f"uuid='{mdev_uuid}'" in xml and "managed='no'" in xml and "display='on'" in xml
    meta = read_allocations(xml)  # the state can be rebuilt from libvirt alone
    assert {m.get("uuid") or m.get("pci_address") for m in meta} == {mdev_uuid, "0000:3d:00.4"}
    assert [v["name"] for v in svc.list_vms() if v["name"] == "web1"] == ["web1"]
    out = svc.delete_vm("web1")
    assert set(out["released"]) == {mdev_uuid, "0000:3d:00.4"}
    assert discover_mdevs(svc.host) == [] and discover_vf_vgpus(svc.host) == []
    assert not svc.virt().exists("web1")
    acts = [a for a, _ in events(svc, vm="web1")]
    assert acts.index("vm.define") < acts.index("vm.start") < acts.index("vm.undefine")


def test_print_xml_changes_nothing(tmp_path: Path) -> None:
    svc = make_service(tmp_path)
    res = svc.create_vm("dry", vgpus=["T4-4Q"], passthrough=["0000:00:02.0"], print_xml=True)
    assert "<hostdev" in res["xml"] and "0x02" in res["xml"]
    assert discover_mdevs(svc.host) == [] and svc.allocations() == [] and not svc.virt().exists("dry")
    assert events(svc) == []


@pytest.mark.parametrize("step", ["placement", "device", "define", "start"])
def test_vm_create_rolls_back_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    from vgpumgr.virt import driver as virt_mod

    svc = make_service(tmp_path)
    vgpus = ["T4-4Q", "L40S-2Q"]
    if step == "placement":
        vgpus = ["T4-4Q", "T4-99Q"]
    elif step == "device":
        real = mdev_backend.create

        def fail_second(host, parent, type_id, uuid=None, timeout=10.0):  # noqa: ANN001, ANN202
            raise KernelError("creating mdev failed (EIO)")
        monkeypatch.setattr(mdev_backend, "create", fail_second)
        vgpus = ["L40S-2Q", "T4-4Q"]
        assert real
    elif step == "define":
        monkeypatch.setattr(virt_mod.Virt, "define", lambda self, xml, **k: (_ for _ in ()).throw(
            VgpuError("libvirt refused the domain")))
    else:
        monkeypatch.setattr(virt_mod.Virt, "start", lambda self, name: (_ for _ in ()).throw(
            VgpuError("QEMU failed to start")))
    with pytest.raises(VgpuError):
        svc.create_vm("web1", vgpus=vgpus, start=True)
    assert discover_mdevs(svc.host) == [] and discover_vf_vgpus(svc.host) == []
    assert svc.allocations(live=True) == []
    assert not svc.virt().exists("web1")
    assert events(svc, vm="web1")[-1] == ("vm.create", "failed")


def test_vm_name_and_disk_injection_refused(tmp_path: Path) -> None:
    svc = make_service(tmp_path)
    for name in ("a<b", "x'; rm -rf /", "../etc", "a&b"):
        with pytest.raises(InvalidInput):
            svc.create_vm(name, vgpus=["T4-4Q"])
    with pytest.raises(InvalidInput):
        svc.create_vm("ok", vgpus=["T4-4Q"], disk="relative/path.qcow2")
    assert svc.allocations() == []


def test_vm_start_recreates_vanished_vgpus(tmp_path: Path) -> None:
    from vgpumgr.sim.reboot import reboot

    svc = make_service(tmp_path)
    res = svc.create_vm("web1", vgpus=["T4-4Q"])
    reboot(svc.host.root)
    assert discover_mdevs(svc.host) == []
    svc.start_vm("web1")
    assert [m.uuid for m in discover_mdevs(svc.host)] == [res["allocations"][0]["uuid"]]


def test_attach_and_detach(tmp_path: Path) -> None:
    svc = make_service(tmp_path)
    svc.create_vm("web1", vgpus=["T4-4Q"])
    a = svc.attach_vgpu("web1", "L40S-2Q")
    vf = "bus='0x3d' slot='0x00' function='0x4'"
    assert a["pci_address"] == "0000:3d:00.4" and vf in svc.vm_xml("web1")
    svc.detach_vgpu("web1", a["pci_address"])
    assert vf not in svc.vm_xml("web1") and discover_vf_vgpus(svc.host) == []
    with pytest.raises(NotFound):
        svc.detach_vgpu("web1", "0000:3d:00.5")  # nothing allocated there
    svc.delete_vm("web1")


# -- MIG ---------------------------------------------------------------------------------------------

def test_mig_backed_vm_end_to_end(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "a100-mig", vfs=4)
    res = svc.create_vm("ml1", mig=["3g.40gb"])
    [a] = res["allocations"]
    assert a["type_name"] == "GRID A100D-3-40C" and a["backend"] == "mdev" and a["series"] == "C"
    layer = svc.nvml()
    assert [gi["profile"] for gi in layer.gpus()["0000:65:00.0"]["mig"]["gpu_instances"]] == ["3g.40gb"]
    assert svc.free_gpu_instances(layer) == {"0000:65:00.0": []}
    b = svc.create_vm("ml2", mig=["3g.40gb"])["allocations"][0]
    assert b["parent"] != a["parent"]
    with pytest.raises(NoCapacity, match="no GPU has room"):
        svc.create_vm("ml3", mig=["4g.40gb"])
    svc.delete_vm("ml1")
    # the GPU instance stays and is reused by the next request
    c = svc.create_vm("ml4", mig=["3g.40gb"])["allocations"][0]
    assert c["type"] == "nvidia-701"
    assert [gi["profile"] for gi in layer.gpus()["0000:65:00.0"]["mig"]["gpu_instances"]] == ["3g.40gb", "3g.40gb"]


# -- reconcile ---------------------------------------------------------------------------------------

def test_reconcile_after_a_simulated_reboot(tmp_path: Path) -> None:
    from vgpumgr.sim.reboot import reboot

    svc = make_service(tmp_path)
    a = svc.allocate("T4-4Q", vm="web1")
    b = svc.allocate("L40S-2Q", vm="web1")
    reboot(svc.host.root)
    from vgpumgr.backends import sriov  # a reboot disables the VFs; sriov-manage -e (later `restore`) brings them back

    sriov.set_numvfs(svc.host, "0000:3d:00.0", 8, allow_nvidia=True)
    stray = mdev_backend.create(svc.host, "0000:00:02.0", "i915-GVTg_V5_4")  # made behind vgpumgr's back
    r = svc.reconcile()
    assert set(r["missing"]) == {a["uuid"], b["pci_address"]}
    assert [u["uuid"] for u in r["unknown"]] == [stray.uuid]
    assert r["restored"] == [] and events(svc)[-1] == ("reconcile", "warning")
    r = svc.reconcile(fix=True)
    assert set(r["restored"]) == {a["uuid"], b["pci_address"]} and r["removed"] == []
    assert {m.uuid for m in discover_mdevs(svc.host)} == {a["uuid"], stray.uuid}
    r = svc.reconcile(fix=True, remove_unknown=True)
    assert r["removed"] == [stray.uuid] and r["missing"] == []
    assert {m.uuid for m in discover_mdevs(svc.host)} == {a["uuid"]}


def test_mig_backed_vgpu_on_the_vendor_vf_interface(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "h100-mig", vfs=4)
    assert svc.snapshot().inventory.types == []  # MIG on and no GPU instance yet: nothing is creatable
    a = svc.create_vm("ml1", mig=["1g.10gb"])["allocations"][0]
    b = svc.create_vm("ml2", mig=["1g.10gb+me"])["allocations"][0]
    assert (a["type_name"], a["backend"], a["pci_address"]) == ("NVIDIA H100XM-1-10C", "nvidia-vf", "0000:19:00.4")
    assert (b["type_name"], b["pci_address"]) == ("NVIDIA H100XM-1-10CME", "0000:19:00.5")
    assert "managed='no'" in svc.vm_xml("ml1")
    gis = svc.nvml().gpus()["0000:19:00.0"]["mig"]["gpu_instances"]
    assert sorted(gi["profile"] for gi in gis) == ["1g.10gb", "1g.10gb+me"]
    assert {v.address: v.type for v in discover_vf_vgpus(svc.host)} == {"0000:19:00.4": "nvidia-1131",
                                                                         "0000:19:00.5": "nvidia-1130"}
