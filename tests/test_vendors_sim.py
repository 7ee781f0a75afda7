"""The simulated vendor cards (sim/vendor_gpus.py, docs/sources.md §18): their sysfs layout, what the kernel
emulator and the simulated npu-smi do to them, and what `sim reboot` takes away."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from simhost import make

from vgpumgr.backends import mdev
from vgpumgr.discovery.inventory import discover_types
from vgpumgr.discovery.pci import discover_gpus
from vgpumgr.errors import NoCapacity
from vgpumgr.hostfs.root import Host
from vgpumgr.sim.reboot import reboot
from vgpumgr.sim.vendor_gpus import NPU_SMI

ASCEND, MTT, MLU, MI300X, FLEX, BMG = ("0000:81:00.0", "0000:85:00.0", "0000:87:00.0", "0000:89:00.0",
                                       "0000:8b:00.0", "0000:8d:00.0")


def _avail(host: Host, parent: str) -> dict[str, int]:
    return {t.type: t.available_instances for t in discover_types(host, parent)}


def _npu_smi(host: Host, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(host.root / NPU_SMI), *argv], capture_output=True, text=True, timeout=60)


def _write_errno(host: Host, path: Path, data: str) -> int | None:
    try:
        host.write(path, data)
    except OSError as e:
        return e.errno
    return None


def test_every_vendor_named_and_classified(tmp_path: Path) -> None:
    host = make(tmp_path, "all")
    names = {g.address: g.name for g in discover_gpus(host) if not g.is_vf}
    assert names[ASCEND] == "Huawei Ascend 310P"  # 19e5:d500 is not in pci.ids: the vendor table names it
    assert names["0000:83:00.0"] == "Huawei Ascend 910B"
    assert names[MTT] == "Moore Threads MTT S4000"
    assert names[MLU] == "Cambricon MLU370-S4"
    assert names[MI300X] == "AMD Instinct MI300X"
    assert names[FLEX] == "Intel Data Center GPU Flex 170"
    assert names[BMG] == "Intel Arc Pro B60"
    assert names["0000:8f:00.0"] == "Hygon DCU K100_AI"
    assert names["0000:91:00.0"] == "MetaX C500"
    assert names["0000:93:00.0"] == "Enflame S60"
    assert names["0000:3b:00.0"] == "NVIDIA TU104GL [Tesla T4]"  # NVIDIA still from pci.ids
    # processing accelerators (class 0x12) are found although they are not display devices
    assert (host.pci(ASCEND) / "class").read_text() == "0x120000\n"


def test_ascend_types_offer_nothing_until_vm_mode(tmp_path: Path) -> None:
    host = make(tmp_path, "ascend-310p")
    t = {x.type: x for x in discover_types(host, ASCEND)}
    assert set(t) == {"vnpu-vir01", "vnpu-vir02", "vnpu-vir04"}
    assert (t["vnpu-vir02"].framebuffer_mb, t["vnpu-vir02"].params["aicore"]) == (6144, "2")
    assert "memory size: 6GB" in (host.mdev_type(ASCEND, "vnpu-vir02") / "description").read_text()
    assert _avail(host, ASCEND) == {"vnpu-vir01": 0, "vnpu-vir02": 0, "vnpu-vir04": 0}
    with pytest.raises(NoCapacity):
        mdev.create(host, ASCEND, "vnpu-vir01")
    done = _npu_smi(host, "set", "-t", "vnpu-mode", "-d", "1")
    assert done.returncode == 0, done.stderr
    assert _avail(host, ASCEND) == {"vnpu-vir01": 7, "vnpu-vir02": 3, "vnpu-vir04": 1}  # as seen on a 300I Duo
    m = mdev.create(host, ASCEND, "vnpu-vir01")
    assert _avail(host, ASCEND) == {"vnpu-vir01": 6, "vnpu-vir02": 3, "vnpu-vir04": 1}
    hw = host.mdev(m.uuid) / "hw_vdavinci"
    assert (hw / "hw_id").read_text() == "Device [19e5:d500]\n"
    assert (hw / "vf").read_text() == "0000:81:00.1\n"  # the SR-IOV VF behind this vNPU
    # the mode cannot change while vNPUs of VM mode exist
    refused = _npu_smi(host, "set", "-t", "vnpu-mode", "-d", "0")
    assert refused.returncode != 0 and "destroy them" in refused.stderr
    assert mdev.remove(host, m.uuid)
    assert _avail(host, ASCEND)["vnpu-vir01"] == 7


def test_ascend_container_vnpus_block_vm_mode_and_a_reboot_resets_it(tmp_path: Path) -> None:
    host = make(tmp_path, "ascend-310p")
    made = _npu_smi(host, "set", "-t", "create-vnpu", "-i", "0", "-c", "0", "-f", "vir02")
    assert made.returncode == 0 and "vnpu_id : 100" in made.stdout
    refused = _npu_smi(host, "set", "-t", "vnpu-mode", "-d", "1")
    assert refused.returncode == 1 and "container vNPUs (100)" in refused.stderr
    assert _npu_smi(host, "set", "-t", "destroy-vnpu", "-i", "0", "-c", "0", "-v", "100").returncode == 0
    assert _npu_smi(host, "set", "-t", "vnpu-mode", "-d", "1").returncode == 0
    assert "vm (1)" in _npu_smi(host, "info", "-t", "vnpu-mode").stdout
    mdev.create(host, ASCEND, "vnpu-vir04")
    lost = reboot(host.root)
    assert lost["mdevs"] == 1 and ASCEND in lost["vendor"]
    assert _avail(host, ASCEND) == {"vnpu-vir01": 0, "vnpu-vir02": 0, "vnpu-vir04": 0}


def test_mtt_capacity_from_count_and_memory(tmp_path: Path) -> None:
    host = make(tmp_path, "mtt-s4000")
    t = {x.type: x for x in discover_types(host, MTT)}
    assert t["mtgpu-2132"].framebuffer_mb == 32 * 1024 and t["mtgpu-2132"].params["displays"] == "2"
    assert t["mtgpu-1104"].params == {"displays": "1", "resolution": "1K"}
    assert _avail(host, MTT)["mtgpu-1101"] == 8  # Quyuan2: at most 8 vGPUs per chip
    mdev.create(host, MTT, "mtgpu-2132")
    a = _avail(host, MTT)
    assert (a["mtgpu-2132"], a["mtgpu-2116"], a["mtgpu-1108"], a["mtgpu-1101"]) == (0, 1, 2, 7)


def test_gim_owns_the_vf_count(tmp_path: Path) -> None:
    host = make(tmp_path, "mi300x")
    pf = host.pci(MI300X)
    assert (host.root / "sys/module/gim/parameters/vf_num").read_text() == "8\n"
    assert (pf / "sriov_numvfs").read_text() == "8\n"
    assert (pf / "spatial_partition_mode").read_text() == "CPX\n"
    assert (pf / "memory_partition_mode").read_text() == "NPS4\n"
    vfs = [g for g in discover_gpus(host) if g.physfn == MI300X]
    assert len(vfs) == 8 and {g.device_id for g in vfs} == {"74b5"}
    # GIM has no .sriov_configure: the kernel answers ENOENT (after the range and no-op checks)
    assert _write_errno(host, pf / "sriov_numvfs", "1") == errno.ENOENT
    assert _write_errno(host, pf / "sriov_numvfs", "9") == errno.ERANGE
    assert _write_errno(host, pf / "sriov_numvfs", "8") is None
    # without the modprobe.d option, GIM loads with its default vf_num=1 after a reboot
    os.unlink(host.root / "etc/modprobe.d/gim.conf")
    lost = reboot(host.root)
    assert MI300X not in lost["vfs"] and "vf_num=1" in lost["vendor"][MI300X]
    assert (pf / "sriov_numvfs").read_text() == "1\n" and (pf / "spatial_partition_mode").read_text() == "SPX\n"


def test_i915_quotas(tmp_path: Path) -> None:
    host = make(tmp_path, "flex170")
    iov = host.pci(FLEX) / "drm/card1/iov"
    assert (host.root / "sys/class/drm/card1").resolve() == (host.pci(FLEX) / "drm/card1").resolve()
    free = int((iov / "pf/gt/available/lmem_free").read_text())
    assert free == 16000 << 20
    assert _write_errno(host, iov / "vf1/gt/lmem_quota", str(free + 1)) == errno.ENOSPC
    assert _write_errno(host, iov / "vf1/gt/lmem_quota", "x") == errno.EINVAL
    assert _write_errno(host, iov / "vf1/gt/lmem_quota", str(2000 << 20)) is None
    assert int((iov / "pf/gt/available/lmem_free").read_text()) == 14000 << 20
    host.write(host.pci(FLEX) / "sriov_numvfs", "2")
    # VF 2 had no quota: the driver provisions it from what is free; each enabled VF gets its device link
    assert int((iov / "vf2/gt/lmem_quota").read_text()) == 14000 << 20
    assert os.path.basename(os.readlink(iov / "vf1/device")) == "0000:8b:00.4"
    reboot(host.root)
    assert (iov / "vf1/gt/lmem_quota").read_text() == "0\n" and not (iov / "vf1/device").exists()


def test_xe_vram_quota_only_before_the_vfs(tmp_path: Path) -> None:
    host = make(tmp_path, "bmg")
    admin = host.pci(BMG) / "sriov_admin"
    assert (admin / "vf1/profile/sched_priority").read_text() == "low\n"
    assert _write_errno(host, admin / "vf1/profile/vram_quota", str(25 << 30)) == errno.EINVAL  # > 24 GiB
    assert _write_errno(host, admin / "vf1/profile/vram_quota", str(4 << 30)) is None
    host.write(host.pci(BMG) / "sriov_numvfs", "2")
    assert _write_errno(host, admin / "vf1/profile/vram_quota", str(2 << 30)) == errno.EPERM
    assert (admin / "vf1/profile/vram_quota").read_text() == f"{4 << 30}\n"
    assert os.path.basename(os.readlink(admin / "vf2/device")) == "0000:8d:00.5"
    t = {x.parent: x for x in discover_types(host, BMG)}
    assert t["0000:8d:00.4"].framebuffer_mb == 4096 and t["0000:8d:00.4"].name == "Intel ArcProB60-1of2"


def test_cambricon_vfs_through_sriov_numvfs(tmp_path: Path) -> None:
    host = make(tmp_path, "mlu370")
    assert discover_types(host, MLU) == []
    host.write(host.pci(MLU) / "sriov_numvfs", "4")
    t = discover_types(host, MLU)
    assert [x.parent for x in t] == ["0000:87:00.4", "0000:87:00.5", "0000:87:00.6", "0000:87:00.7"]
    assert {(x.type, x.name, x.backend, x.framebuffer_mb) for x in t} == {
        ("vf-mlu370s4_1of4", "Cambricon MLU370-S4-1of4", "vf", 6144)}


def test_vendor_profiles_build_alone(tmp_path: Path) -> None:
    for profile in ("ascend-910b", "dcu-k100", "metax-c500", "enflame-s60"):
        host = make(tmp_path, profile)
        [g] = discover_gpus(host)
        assert g.backends == ["passthrough"] and discover_types(host) == []


def test_vendor_profiles_refuse_scale_and_vfs(tmp_path: Path) -> None:
    from vgpumgr.errors import InvalidInput

    with pytest.raises(InvalidInput, match="--scale 1 only"):
        make(tmp_path, "all", scale=2)
    with pytest.raises(InvalidInput, match="vendor prepare"):
        make(tmp_path, "mlu370", vfs=2)
    assert not (tmp_path / "sim-all").exists() and not (tmp_path / "sim-mlu370").exists()  # nothing half-made
