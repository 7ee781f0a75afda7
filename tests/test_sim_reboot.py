"""`vgpumgr sim reboot` takes away what a real reboot takes away (docs/sources.md §11), per profile."""

from __future__ import annotations

import json
import os
from pathlib import Path

from simhost import make, run

from vgpumgr.backends import mdev, nvidia_vf, sriov
from vgpumgr.discovery.inventory import discover_types
from vgpumgr.discovery.mdev import discover_mdevs
from vgpumgr.discovery.nvidia_vf import discover_vf_vgpus
from vgpumgr.discovery.pci import discover_gpus
from vgpumgr.hostfs.root import Host
from vgpumgr.nvidia.nvml import NvmlLayer
from vgpumgr.sim.kernel import KernelEmulator
from vgpumgr.sim.mig_link import sync_from_nvml
from vgpumgr.sim.nvml import SimNvml
from vgpumgr.sim.platform import nvml_state_path as sim_state_path
from vgpumgr.sim.reboot import reboot
from vgpumgr.sim.tree import SimTree


def _layer(host: Host) -> NvmlLayer:
    return NvmlLayer(SimNvml(sim_state_path(host.root)))


def _nvml_gpu(host: Host, address: str) -> dict:
    state = json.loads(sim_state_path(host.root).read_text())
    return next(g for g in state["gpus"] if g["address"] == address)


def _groups(host: Host) -> dict[str, int]:
    return {g.address: g.iommu_group for g in discover_gpus(host)}


def _vfs_gone(host: Host, pf: str, vfs: list[str]) -> None:
    d = host.pci(pf)
    assert (d / "sriov_numvfs").read_text() == "0\n"
    assert not [f for f in os.listdir(d) if f.startswith("virtfn")]
    for vf in vfs:
        assert not host.pci(vf).exists() and not (d.parent / vf).exists()  # the link and the device dir
        assert not (host.mdev_bus / vf).exists()
    assert not [g for g in discover_gpus(host) if g.physfn == pf]


def test_t4_loses_its_mdevs_and_nothing_else(tmp_path: Path) -> None:
    host = make(tmp_path, "t4")
    before = _groups(host)
    made = [mdev.create(host, "0000:3b:00.0", "nvidia-232") for _ in range(2)]  # T4-4Q
    lost = reboot(host.root)
    assert (lost["mdevs"], lost["vfs"], lost["gpu_instances"], lost["mig_off"]) == (2, {}, {}, [])
    assert discover_mdevs(host) == [] and all(mdev.get(host, m.uuid) is None for m in made)
    assert _groups(host) == before and lost["iommu_groups"] == {}
    types = {t.type: t.available_instances for t in discover_types(host, "0000:3b:00.0")}
    assert types["nvidia-232"] == 4 and types["nvidia-222"] == 16  # equal-size rule forgotten with the mdevs
    assert sorted(os.listdir(host.root / "dev/vfio")) == [".group-10", "vfio"]  # the mdevs' groups went too


def test_a_gpu_left_on_vfio_pci_comes_back_on_its_default_driver(tmp_path: Path) -> None:
    host = make(tmp_path, "t4")
    kernel = KernelEmulator(host)
    d = host.pci("0000:3b:00.0")
    kernel.write(d / "driver_override", "vfio-pci")
    kernel.write(d / "driver/unbind", "0000:3b:00.0")
    kernel.write(host.sys / "bus/pci/drivers_probe", "0000:3b:00.0")
    assert os.readlink(d / "driver").endswith("/vfio-pci") and (host.root / "dev/vfio/10").exists()
    lost = reboot(host.root)
    assert lost["drivers"] == {"0000:3b:00.0": ["vfio-pci", "nvidia"]}
    assert os.readlink(d / "driver").endswith("/nvidia") and (d / "driver_override").read_text() == "(null)\n"
    assert not (host.root / "dev/vfio/10").exists()


def test_a40_loses_its_vfs_and_their_mdevs(tmp_path: Path) -> None:
    host = make(tmp_path, "a40-sriov", vfs=4)
    vfs = sriov.vfs(host, "0000:41:00.0")
    m = mdev.create(host, vfs[1], "nvidia-558")
    lost = reboot(host.root)
    assert (lost["mdevs"], lost["vfs"]) == (1, {"0000:41:00.0": 4})
    _vfs_gone(host, "0000:41:00.0", vfs)
    assert discover_types(host) == [] and mdev.get(host, m.uuid) is None
    # they come back only when something enables them (sriov-manage -e; here the sriov backend), empty
    assert sriov.set_numvfs(host, "0000:41:00.0", 4, allow_nvidia=True) == vfs
    assert discover_mdevs(host) == []
    a40_2q = [t for t in discover_types(host) if t.type == "nvidia-558"]
    assert [t.parent for t in a40_2q] == vfs and all(t.available_instances == 1 for t in a40_2q)


def test_l40s_loses_its_vfs_and_every_vgpu_type(tmp_path: Path) -> None:
    host = make(tmp_path, "l40s-vfio", vfs=4)
    vfs = sriov.vfs(host, "0000:3d:00.0")
    nvidia_vf.set_type(host, vfs[0], "nvidia-1148")
    nvidia_vf.set_type(host, vfs[2], "nvidia-1148")
    lost = reboot(host.root)
    assert (lost["mdevs"], lost["vf_vgpus"], lost["vfs"]) == (0, 2, {"0000:3d:00.0": 4})
    _vfs_gone(host, "0000:3d:00.0", vfs)
    assert discover_vf_vgpus(host) == []
    sriov.set_numvfs(host, "0000:3d:00.0", 4, allow_nvidia=True)
    assert [nvidia_vf.current(host, vf) for vf in vfs] == [0, 0, 0, 0]  # no VF remembers its type
    assert all(any(name == "NVIDIA L40S-48Q" for _, name in nvidia_vf.creatable(host, vf)) for vf in vfs)


def test_a100_keeps_mig_mode_but_loses_its_gpu_instances(tmp_path: Path) -> None:
    host = make(tmp_path, "a100-mig", vfs=4)
    layer = _layer(host)
    layer.create_gpu_instance("0000:65:00.0", "3g.40gb")
    sync_from_nvml(host.root, layer)
    vfs = sriov.vfs(host, "0000:65:00.0")
    mdev.create(host, vfs[0], "nvidia-701")  # GRID A100D-3-40C on the GPU instance
    lost = reboot(host.root)
    assert lost["gpu_instances"] == {"0000:65:00.0": 1} and lost["mig_off"] == [] and lost["mdevs"] == 1
    gpu = _nvml_gpu(host, "0000:65:00.0")
    assert gpu["mig_mode"] == [1, 1] and gpu["gpu_instances"] == []  # Ampere keeps MIG mode in the InfoROM
    assert layer.gpus()["0000:65:00.0"]["mig"]["gpu_instances"] == []
    _vfs_gone(host, "0000:65:00.0", vfs)
    sriov.set_numvfs(host, "0000:65:00.0", 4, allow_nvidia=True)
    avail = {t.type: t.available_instances for t in discover_types(host, vfs[0])}
    assert avail["nvidia-701"] == 0 and avail["nvidia-692"] == 0  # MIG on, no GPU instance: nothing creatable


def test_a100_pending_mig_mode_takes_effect_at_the_reboot(tmp_path: Path) -> None:
    host = make(tmp_path, "a100-mig", vfs=2)
    nvml = SimNvml(sim_state_path(host.root))
    nvml.nvmlInit()
    nvml.nvmlDeviceSetMigMode(nvml.nvmlDeviceGetHandleByIndex(0), 0)
    assert _nvml_gpu(host, "0000:65:00.0")["mig_mode"] == [1, 0]  # Ampere: pending until a GPU reset
    reboot(host.root)
    assert _nvml_gpu(host, "0000:65:00.0")["mig_mode"] == [0, 0]
    sriov.set_numvfs(host, "0000:65:00.0", 2, allow_nvidia=True)
    avail = {t.type: t.available_instances for t in discover_types(host, "0000:65:00.4")}
    assert avail["nvidia-692"] == 1 and avail["nvidia-701"] == 0  # time-sliced types are back


def test_h100_loses_mig_mode_gpu_instances_vfs_and_types(tmp_path: Path) -> None:
    host = make(tmp_path, "h100-mig", vfs=4)
    layer = _layer(host)
    layer.create_gpu_instance("0000:19:00.0", "1g.10gb")
    sync_from_nvml(host.root, layer)
    vfs = sriov.vfs(host, "0000:19:00.0")
    nvidia_vf.set_type(host, vfs[0], "nvidia-1131")  # NVIDIA H100XM-1-10C
    lost = reboot(host.root)
    assert (lost["vf_vgpus"], lost["gpu_instances"], lost["mig_off"]) == (1, {"0000:19:00.0": 1}, ["0000:19:00.0"])
    gpu = _nvml_gpu(host, "0000:19:00.0")
    assert gpu["mig_mode"] == [0, 0] and gpu["gpu_instances"] == []  # Hopper does not keep MIG mode
    assert layer.gpus()["0000:19:00.0"]["mig"]["current"] == "disabled"
    assert SimTree(host.root).state["gpus"]["0000:19:00.0"]["mig"] is False  # the driver's view follows NVML
    _vfs_gone(host, "0000:19:00.0", vfs)
    sriov.set_numvfs(host, "0000:19:00.0", 4, allow_nvidia=True)
    assert [nvidia_vf.current(host, vf) for vf in vfs] == [0] * 4


def test_mixed_host_reboot_and_iommu_groups_renumbered_in_enumeration_order(tmp_path: Path) -> None:
    host = make(tmp_path, "mixed", vfs=2)
    pfs = ["0000:00:02.0", "0000:3b:00.0", "0000:3d:00.0", "0000:65:00.0"]
    before = _groups(host)
    # built at run time: each PF, then its VFs, so the A100 PF sits after the L40S VFs
    assert [before[p] for p in pfs] == [10, 11, 12, 15]
    mdev.create(host, "0000:3b:00.0", "nvidia-232")
    mdev.create(host, "0000:00:02.0", "i915-GVTg_V5_4")
    nvidia_vf.set_type(host, "0000:3d:00.4", "nvidia-1148")
    rc, out, err = run("--sysfs-root", str(host.root), "sim", "reboot", "--json")
    assert rc == 0, err
    lost = json.loads(out)
    assert (lost["mdevs"], lost["vf_vgpus"]) == (2, 1)
    assert lost["vfs"] == {"0000:3d:00.0": 2, "0000:65:00.0": 2} and lost["mig_off"] == []
    assert lost["iommu_groups"] == {"0000:65:00.0": [15, 13]}
    after = _groups(host)
    assert list(after) == pfs and [after[p] for p in pfs] == [10, 11, 12, 13]  # bus order after the boot
    assert sorted(os.listdir(host.sys / "kernel/iommu_groups"), key=int) == ["10", "11", "12", "13"]
    assert discover_mdevs(host) == [] and discover_vf_vgpus(host) == []
    # VFs enabled after the boot in another order than at build time take the next numbers in that order
    sriov.set_numvfs(host, "0000:65:00.0", 2, allow_nvidia=True)
    sriov.set_numvfs(host, "0000:3d:00.0", 2, allow_nvidia=True)
    again = _groups(host)
    assert [again[v] for v in ("0000:65:00.4", "0000:65:00.5", "0000:3d:00.4", "0000:3d:00.5")] == [14, 15, 16, 17]
    assert before["0000:3d:00.4"] == 13 and again["0000:3d:00.4"] == 16  # same VF, a new group number
    assert os.readlink(host.pci("0000:3d:00.4") / "iommu_group").endswith("/16")


def test_reboot_text_output_names_what_was_lost(tmp_path: Path) -> None:
    host = make(tmp_path, "h100-mig", vfs=2)
    rc, out, err = run("--sysfs-root", str(host.root), "sim", "reboot")
    assert rc == 0, err
    assert "0000:19:00.0: 2 VF(s) disabled" in out and "0000:19:00.0: MIG mode is off again" in out
    rc, out, err = run("--sysfs-root", str(tmp_path), "sim", "reboot")
    assert rc != 0 and "only works on a simulated root" in err
