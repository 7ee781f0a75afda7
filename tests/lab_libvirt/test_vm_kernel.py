"""vgpumgr's VM lifecycle on the lab guest's real libvirtd, QEMU and kernel (scripts/mdev-lab run --libvirt).

create_vm must start a domain whose QEMU really opened the mdev's VFIO group. While it runs, removing the mdev
must be refused at once: the kernel would block the writer until the VM lets go (docs/sources.md §1), so vgpumgr
has to find the holder before it writes. delete_vm stops the VM and then removes it.

By default vgpumgr renders <domain type='kvm'> with <cpu mode='host-passthrough'>. The lab's nested QEMU runs
under TCG (the conftest unloads the kvm modules udev loads), where libvirt refuses that domain: the first test
pins the refusal and create_vm's rollback; the second uses VGPUMGR_DOMAIN_TYPE=qemu.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from lxml import etree

from vgpumgr.backends import mdev
from vgpumgr.config import Config
from vgpumgr.errors import Busy, InvalidInput
from vgpumgr.hostfs.root import Host
from vgpumgr.service import Service

LIBVIRT_URI = "qemu:///system"
MDEV_DEVICES = Path("/sys/bus/mdev/devices")
DOMAIN = "labvm"
QUICK = 5.0  # seconds; a remove the kernel blocks on never comes back by itself

pytestmark = pytest.mark.lab


def processes_holding(target: str) -> dict[int, str]:
    """pid -> comm of every process with `target` open, read from /proc without vgpumgr."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            if target in links:
                found[int(pid)] = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue  # the process or one of its fds went away meanwhile
    return found


def service(tmp_path: Path) -> Service:
    cfg = Config.resolve(sysfs_root="/", state_dir=str(tmp_path / "state"), db=f"sqlite:///{tmp_path}/vgpumgr.db",
                         connect=LIBVIRT_URI)
    return Service(cfg, licence_mode="off")


def test_the_default_kvm_domain_is_refused_under_tcg_and_create_vm_rolls_back(
        tmp_path: Path, vm_cleanup: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert not Path("/dev/kvm").exists()
    monkeypatch.delenv("VGPUMGR_DOMAIN_TYPE", raising=False)
    svc = service(tmp_path)
    vm_cleanup.append(DOMAIN)
    before = set(os.listdir(MDEV_DEVICES))
    with pytest.raises(InvalidInput) as refused:
        svc.create_vm(DOMAIN, vgpus=["mtty-1"], memory_mib=128, vcpus=1, start=True)
    assert "does not support virt type 'kvm'" in refused.value.message  # libvirt refuses it at define
    assert set(os.listdir(MDEV_DEVICES)) == before
    assert svc.allocations(live=True) == []
    assert not svc.virt().exists(DOMAIN)


def test_a_running_vm_holds_its_vgpu_and_removing_it_is_refused_until_the_vm_is_deleted(
        tmp_path: Path, virt_conn: object, vm_cleanup: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import libvirt

    monkeypatch.setenv("VGPUMGR_DOMAIN_TYPE", "qemu")
    svc = service(tmp_path)
    vm_cleanup.append(DOMAIN)

    vm = svc.create_vm(DOMAIN, vgpus=["mtty-1"], memory_mib=128, vcpus=1, start=True)
    assert vm["state"] == "running"
    [alloc] = vm["allocations"]
    uid = alloc["uuid"]
    assert (alloc["parent"], alloc["type"]) == ("mtty", "mtty-1")
    dom = virt_conn.lookupByName(DOMAIN)  # type: ignore[attr-defined]
    assert dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING
    live = etree.fromstring(dom.XMLDesc(0).encode())
    assert live.get("type") == "qemu"
    assert live.find("cpu") is None or live.find("cpu").get("mode") != "host-passthrough"
    assert [a.get("uuid") for a in live.iterfind("devices/hostdev[@type='mdev']/source/address")] == [uid]
    group = f"/dev/vfio/{os.path.basename(os.readlink(MDEV_DEVICES / uid / 'iommu_group'))}"
    qemu = int(Path(f"/run/libvirt/qemu/{DOMAIN}.pid").read_text())
    holders = processes_holding(group)
    assert list(holders) == [qemu]
    assert holders[qemu].startswith("qemu-system")

    started = time.monotonic()
    with pytest.raises(Busy) as direct:
        mdev.remove(Host("/"), uid)
    assert time.monotonic() - started < QUICK
    assert f"[{qemu}]" in direct.value.message

    started = time.monotonic()
    with pytest.raises(Busy) as released:
        svc.release(uid)
    assert time.monotonic() - started < QUICK
    assert f"[{qemu}]" in released.value.message
    assert f"running libvirt domain {DOMAIN}" in released.value.message
    # No remove was written: the kernel unlinks the device at once even when the writer then blocks.
    assert (MDEV_DEVICES / uid).exists()
    assert [a["uuid"] for a in svc.allocations(live=True)] == [uid]

    deleted = svc.delete_vm(DOMAIN)
    assert deleted["released"] == [uid]
    assert not (MDEV_DEVICES / uid).exists()
    assert DOMAIN not in [d.name() for d in virt_conn.listAllDomains(0)]  # type: ignore[attr-defined]
    assert processes_holding(group) == {}
    assert svc.allocations(live=True) == []
