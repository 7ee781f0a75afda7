"""Each simulated profile builds a tree laid out as the kernel lays it out, with real NVIDIA ids."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from simhost import make

from vgpumgr.discovery.inventory import discover_types, scan
from vgpumgr.discovery.mdev import discover_mdevs
from vgpumgr.discovery.pci import discover_gpus
from vgpumgr.errors import Conflict, InvalidInput
from vgpumgr.sim import profiles


def test_t4_is_legacy_mdev_on_the_pf(tmp_path: Path) -> None:
    host = make(tmp_path, "t4")
    [gpu] = discover_gpus(host)
    assert (gpu.address, gpu.vendor_id, gpu.device_id, gpu.driver) == ("0000:3b:00.0", "10de", "1eb8", "nvidia")
    assert gpu.name == "NVIDIA TU104GL [Tesla T4]" and gpu.sriov is None and gpu.physfn is None
    assert gpu.numa_node == 0 and isinstance(gpu.iommu_group, int)
    link = os.readlink(host.mdev_bus / "0000:3b:00.0")
    assert link == "../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0"
    types = {t.type: t for t in discover_types(host)}
    assert types["nvidia-232"].name == "GRID T4-4Q"
    assert types["nvidia-232"].description == ("num_heads=4, frl_config=60, framebuffer=4096M, "
                                               "max_resolution=7680x4320, max_instance=4")
    assert types["nvidia-222"].available_instances == 16 and types["nvidia-252"].name == "GRID T4-1B4"
    assert len(types) == 17


def test_a40_has_32_vfs_with_mdev_types_and_none_on_the_pf(tmp_path: Path) -> None:
    host = make(tmp_path, "a40-sriov")
    gpus = {g.address: g for g in discover_gpus(host)}
    pf = gpus["0000:41:00.0"]
    assert pf.sriov and (pf.sriov.totalvfs, pf.sriov.numvfs) == (32, 32)
    assert pf.sriov.vfs[0] == "0000:41:00.4" and pf.sriov.vfs[31] == "0000:41:04.3"
    vf = gpus["0000:41:00.4"]
    assert vf.physfn == "0000:41:00.0" and vf.backends == ["mdev"]
    assert os.readlink(host.pci("0000:41:00.4") / "physfn") == "../0000:41:00.0"
    types = discover_types(host, "0000:41:00.4")
    a40_2q = next(t for t in types if t.type == "nvidia-558")
    assert a40_2q.name == "NVIDIA A40-2Q" and a40_2q.available_instances == 1 and a40_2q.gpu == "0000:41:00.0"
    assert a40_2q.max_instance == 24
    assert discover_types(host, "0000:41:00.0") == []


def test_l40s_uses_the_vendor_specific_vf_interface(tmp_path: Path) -> None:
    host = make(tmp_path, "l40s-vfio")
    text = (host.pci("0000:3d:00.4") / "nvidia/creatable_vgpu_types").read_text()
    assert text.startswith("ID    : vGPU Name\n1145  : NVIDIA L40S-1B\n")
    assert "2164  : NVIDIA L40S-3B\n" in text
    assert (host.pci("0000:3d:00.4") / "nvidia/current_vgpu_type").read_text() == "0\n"
    assert not host.mdev_bus.joinpath("0000:3d:00.4").exists()
    t = next(t for t in discover_types(host, "0000:3d:00.4") if t.type == "nvidia-1148")
    assert (t.name, t.backend, t.framebuffer_mb, t.gpu) == ("NVIDIA L40S-2Q", "nvidia-vf", 2048, "0000:3d:00.0")


def test_a100_mig_offers_only_mig_backed_types_once_a_gpu_instance_exists(tmp_path: Path) -> None:
    host = make(tmp_path, "a100-mig")
    types = discover_types(host, "0000:65:00.4")
    names = {t.name for t in types}
    assert {"GRID A100D-1-10C", "GRID A100D-7-80C", "GRID A100D-40C"} <= names
    assert all(t.available_instances == 0 for t in types)  # MIG on, no GPU instance yet
    mig = next(t for t in types if t.name == "GRID A100D-3-40C")
    assert mig.mig_slices == 3 and mig.series == "C"


def test_gvtg_budget(tmp_path: Path) -> None:
    host = make(tmp_path, "gvtg")
    [gpu] = discover_gpus(host)
    assert gpu.class_code == "0x030000" and gpu.driver == "i915"
    t = {t.type: t for t in discover_types(host)}
    assert {k: v.available_instances for k, v in t.items()} == {
        "i915-GVTg_V5_1": 1, "i915-GVTg_V5_2": 2, "i915-GVTg_V5_4": 4, "i915-GVTg_V5_8": 8}
    assert t["i915-GVTg_V5_4"].params["low_gm_size"] == "128MB"
    assert not (host.mdev_type("0000:00:02.0", "i915-GVTg_V5_4") / "name").exists()  # GVT-g has no name file


def test_mixed_host_has_every_kind(tmp_path: Path) -> None:
    inv = scan(make(tmp_path, "mixed"))
    pfs = {g.address: g for g in inv.gpus if not g.is_vf}
    assert set(pfs) == {"0000:00:02.0", "0000:3b:00.0", "0000:3d:00.0", "0000:65:00.0"}
    assert "nvidia-vf" in pfs["0000:3d:00.0"].backends and "mdev" in pfs["0000:65:00.0"].backends
    assert {t.backend for t in inv.types} == {"mdev", "nvidia-vf"}
    assert inv.mdevs == [] and inv.vf_vgpus == []


def test_scale_multiplies_gpus(tmp_path: Path) -> None:
    host = make(tmp_path, "a40-sriov", scale=3, vfs=4)
    pfs = [g for g in discover_gpus(host) if not g.is_vf]
    assert [g.address for g in pfs] == ["0000:41:00.0", "0000:43:00.0", "0000:45:00.0"]
    assert len({t.parent for t in discover_types(host)}) == 12


def test_profile_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="unknown simulator profile"):
        profiles.create(tmp_path / "x", "nosuch")
    profiles.create(tmp_path / "y", "t4")
    with pytest.raises(Conflict, match="already holds"):
        profiles.create(tmp_path / "y", "t4")
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "precious").write_text("x")
    with pytest.raises(Conflict, match="not a simulated host"):
        profiles.create(tmp_path / "z", "t4", force=True)
    assert discover_mdevs(make(tmp_path, "samples")) == []



def test_sim_create_help_lists_every_profile_from_the_one_table(capsys: pytest.CaptureFixture[str]) -> None:
    from vgpumgr.cli.main import main

    with pytest.raises(SystemExit):
        main(["sim", "create", "--help"])  # argparse writes its help to sys.stdout
    text = " ".join(capsys.readouterr().out.split())
    assert len(profiles.PROFILES) == 19 and "all" in profiles.PROFILES and "mi300x" in profiles.PROFILES
    assert all(f" {name}," in text or f" {name} " in text for name in profiles.PROFILES), text
