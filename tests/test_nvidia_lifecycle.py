"""NVIDIA rules and device lifecycle on the simulated host: equal-size mode, VF vGPUs, SR-IOV, vfio-pci."""

from __future__ import annotations

from pathlib import Path

import pytest
from simhost import make

from vgpumgr.backends import mdev, nvidia_vf, passthrough, sriov
from vgpumgr.discovery.inventory import discover_types
from vgpumgr.errors import Busy, Conflict, InvalidInput, NoCapacity, NotFound


def avail(host, parent):  # noqa: ANN001, ANN201
    return {t.name.split()[-1]: t.available_instances for t in discover_types(host, parent)}


def test_t4_equal_size_mode(tmp_path: Path) -> None:
    host = make(tmp_path, "t4")
    a = mdev.create(host, "0000:3b:00.0", "nvidia-232")
    left = avail(host, "0000:3b:00.0")
    assert left["T4-4Q"] == 3 and left["T4-4A"] == 3 and left["T4-4C"] == 3
    assert left["T4-2Q"] == 0 and left["T4-1B"] == 0 and left["T4-16Q"] == 0
    with pytest.raises(NoCapacity):
        mdev.create(host, "0000:3b:00.0", "nvidia-231")
    more = [mdev.create(host, "0000:3b:00.0", "nvidia-232").uuid for _ in range(3)]
    assert avail(host, "0000:3b:00.0")["T4-4Q"] == 0
    for u in [a.uuid, *more]:
        mdev.remove(host, u)
    assert avail(host, "0000:3b:00.0")["T4-2Q"] == 8


def test_a40_one_vgpu_per_vf_and_size_rule_across_vfs(tmp_path: Path) -> None:
    host = make(tmp_path, "a40-sriov", vfs=4)
    d = mdev.create(host, "0000:41:00.4", "nvidia-558")  # A40-2Q
    assert d.gpu == "0000:41:00.0"
    assert set(avail(host, "0000:41:00.4").values()) == {0}  # this VF is taken
    other = avail(host, "0000:41:00.5")
    assert other["A40-2Q"] == 1 and other["A40-2B"] == 1 and other["A40-4Q"] == 0
    with pytest.raises(NoCapacity):
        mdev.create(host, "0000:41:00.4", "nvidia-558")


def test_vendor_vf_set_and_clear(tmp_path: Path) -> None:
    host = make(tmp_path, "l40s-vfio", vfs=4)
    assert nvidia_vf.set_type(host, "0000:3d:00.4", "nvidia-1148") == 1148
    assert nvidia_vf.set_type(host, "0000:3d:00.4", 1148) == 1148  # idempotent
    assert (host.pci("0000:3d:00.4") / "nvidia/creatable_vgpu_types").read_text() == "ID    : vGPU Name\n"
    assert {n for _, n in nvidia_vf.creatable(host, "0000:3d:00.5")} == {"NVIDIA L40S-2B", "NVIDIA L40S-2Q",
                                                                          "NVIDIA L40S-2A"}
    with pytest.raises(Conflict, match="already holds"):
        nvidia_vf.set_type(host, "0000:3d:00.4", 1150)
    with pytest.raises(NoCapacity, match="not creatable"):
        nvidia_vf.set_type(host, "0000:3d:00.5", 1150)
    assert nvidia_vf.clear_type(host, "0000:3d:00.4") is True
    assert nvidia_vf.clear_type(host, "0000:3d:00.4") is False  # nothing set: success, no write
    assert len(nvidia_vf.creatable(host, "0000:3d:00.5")) == 23


def test_vendor_vf_clear_refuses_while_held(tmp_path: Path) -> None:
    host = make(tmp_path, "l40s-vfio", vfs=2)
    nvidia_vf.set_type(host, "0000:3d:00.4", 1147)
    group = int((host.pci("0000:3d:00.4") / "iommu_group").readlink().name)
    fd = host.proc / "77" / "fd"
    fd.mkdir(parents=True)
    (host.proc / "77" / "comm").write_text("qemu-system-x86\n")
    (fd / "3").symlink_to(f"/dev/vfio/{group}")
    with pytest.raises(Busy, match=r"qemu-system-x86\[77\]"):
        nvidia_vf.clear_type(host, "0000:3d:00.4", retries=1)
    assert nvidia_vf.current(host, "0000:3d:00.4") == 1147


def test_vendor_vf_bad_input(tmp_path: Path) -> None:
    host = make(tmp_path, "l40s-vfio", vfs=1)
    with pytest.raises(InvalidInput):
        nvidia_vf.set_type(host, "0000:3d:00.4", "nvidia-../../x")
    with pytest.raises(InvalidInput, match="no NVIDIA vendor-specific"):
        nvidia_vf.set_type(host, "0000:3d:00.0", 1147)
    with pytest.raises(NotFound):
        nvidia_vf.set_type(host, "0000:99:00.4", 1147)


def test_sriov_numvfs_rules(tmp_path: Path) -> None:
    host = make(tmp_path, "a40-sriov", vfs=0)
    with pytest.raises(InvalidInput, match="sriov-manage"):
        sriov.set_numvfs(host, "0000:41:00.0", 4)
    assert len(sriov.set_numvfs(host, "0000:41:00.0", 4, allow_nvidia=True)) == 4
    # non-zero to non-zero goes through 0 (the kernel's EBUSY rule)
    assert sriov.set_numvfs(host, "0000:41:00.0", 2, allow_nvidia=True) == ["0000:41:00.4", "0000:41:00.5"]
    with pytest.raises(InvalidInput, match="supports 0..32"):
        sriov.set_numvfs(host, "0000:41:00.0", 33, allow_nvidia=True)
    mdev.create(host, "0000:41:00.5", "nvidia-558")
    with pytest.raises(Busy, match="parent of an mdev"):
        sriov.set_numvfs(host, "0000:41:00.0", 0, allow_nvidia=True)


def test_sriov_kernel_errnos_on_direct_writes(tmp_path: Path) -> None:
    from vgpumgr.backends.common import write

    host = make(tmp_path, "a40-sriov", vfs=2)
    with pytest.raises(Busy) as e:
        write(host, host.pci("0000:41:00.0") / "sriov_numvfs", "3", "raw")
    assert e.value.detail["errno"] == "EBUSY"
    with pytest.raises(InvalidInput) as e2:
        write(host, host.pci("0000:41:00.0") / "sriov_numvfs", "40", "raw")
    assert e2.value.detail["errno"] == "ERANGE"


def test_vfio_bind_and_restore(tmp_path: Path) -> None:
    host = make(tmp_path, "t4")
    memory = passthrough.DriverMemory(tmp_path / "state")
    assert passthrough.bind_vfio(host, "0000:3b:00.0", memory) == "nvidia"
    assert passthrough.driver(host, "0000:3b:00.0") == "vfio-pci"
    assert (host.pci("0000:3b:00.0") / "driver_override").read_text() == "vfio-pci\n"
    assert memory.load() == {"0000:3b:00.0": "nvidia"}
    assert passthrough.bind_vfio(host, "0000:3b:00.0", memory) is None  # already there
    assert passthrough.unbind_vfio(host, "0000:3b:00.0", memory) == "nvidia"
    assert passthrough.driver(host, "0000:3b:00.0") == "nvidia"
    assert (host.pci("0000:3b:00.0") / "driver_override").read_text() == "(null)\n"
    assert memory.load() == {}


def test_vfio_refuses_vendor_vfs(tmp_path: Path) -> None:
    host = make(tmp_path, "l40s-vfio", vfs=1)
    with pytest.raises(InvalidInput, match="must stay on the nvidia driver"):
        passthrough.bind_vfio(host, "0000:3d:00.4", passthrough.DriverMemory(tmp_path))
