"""`sim create --scale N`: every copy is a GPU of its own (address, IOMMU group, NVML index, types)."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
from simhost import make, run

from vgpumgr.discovery.inventory import discover_types
from vgpumgr.discovery.pci import discover_gpus
from vgpumgr.errors import InvalidInput
from vgpumgr.hostfs.root import Host
from vgpumgr.sim import profiles
from vgpumgr.sim.nvml import SimNvml
from vgpumgr.sim.platform import nvml_state_path as sim_state_path

SCALED = ("t4", "a40-sriov", "l40s-vfio", "a100-mig", "h100-mig", "mixed")


def _types_by_gpu(host: Host) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for t in discover_types(host):
        out.setdefault(t.gpu, set()).add(t.type)
    return out


def _nvml_gpus(host: Host) -> list[tuple[str, tuple[int, ...]]]:
    """(PCI address, supported vGPU type ids) per NVML index."""
    path = sim_state_path(host.root)
    if not path.exists():
        return []
    nvml = SimNvml(path)
    nvml.nvmlInit()
    out = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        bus_id = nvml.nvmlDeviceGetPciInfo(handle).busId
        bus_id = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
        out.append((bus_id[4:].lower(), tuple(nvml.nvmlDeviceGetSupportedVgpus(handle))))  # 00000000:3D:00.0
    return out


@pytest.mark.parametrize("profile", SCALED)
def test_every_copy_is_a_gpu_of_its_own(tmp_path: Path, profile: str) -> None:
    base: dict[str, set[str]] = {}  # PCI device id -> the type dirs one GPU of that model offers
    nvml_base: dict[str, tuple[int, ...]] = {}
    base_count: Counter[str] = Counter()
    for scale in range(1, 9):
        host = make(tmp_path / str(scale), profile, scale=scale, vfs=1)  # 1 VF a GPU keeps 8 scales quick
        gpus = discover_gpus(host)
        addresses = [g.address for g in gpus]
        assert len(addresses) == len(set(addresses)), f"{profile} x{scale}: two functions at one address"
        groups = [g.iommu_group for g in gpus]
        assert None not in groups and len(groups) == len(set(groups)), f"{profile} x{scale}: shared IOMMU group"
        assert sorted(os.listdir(host.sys / "kernel/iommu_groups"), key=int) == sorted(map(str, groups), key=int)
        pfs = [g for g in gpus if not g.is_vf]
        for pf in pfs:
            if pf.sriov:
                assert pf.sriov.numvfs == 1 and all(v in addresses for v in pf.sriov.vfs)
        models = Counter(g.device_id for g in pfs)
        types = _types_by_gpu(host)
        nvml = _nvml_gpus(host)
        by_address = {g.address: g for g in pfs}
        if scale == 1:
            base_count = models
            base = {g.device_id: types.get(g.address, set()) for g in pfs}
            nvml_base = {by_address[a].device_id: t for a, t in nvml}
            # H100 with MIG on and no GPU instance creates nothing through sysfs: NVML still lists its types
            assert all(base[m] or nvml_base.get(m) for m in base), f"{profile}: a GPU without types at scale 1"
        copies = {m: n if m == "3e92" else n * scale for m, n in base_count.items()}  # one iGPU, however scaled
        assert models == Counter(copies)
        for pf in pfs:
            assert types.get(pf.address, set()) == base[pf.device_id], f"{pf.address} lost or gained types"
        nvml_addresses = [a for a, _ in nvml]
        assert len(nvml_addresses) == len(set(nvml_addresses)), f"{profile} x{scale}: two NVML indices, one GPU"
        with_nvml = ("26b9", "20b5", "2330") + (("1eb8",) if profile == "mixed" else ())  # the mixed profile's T4
        assert set(nvml_addresses) == {g.address for g in pfs if g.device_id in with_nvml}
        assert all(t == nvml_base[by_address[a].device_id] for a, t in nvml)


def test_mixed_scale_4_places_t4_1q_on_a_t4(tmp_path: Path) -> None:
    host = make(tmp_path, "mixed", scale=4, vfs=2)
    t4s = [g.address for g in discover_gpus(host) if g.device_id == "1eb8"]
    assert len(t4s) == 4
    rc, out, err = run("--sysfs-root", str(host.root), "place", "--type", "T4-1Q", "--vm", "x", "--json")
    assert rc == 0, err
    decision = json.loads(out)
    assert decision["choice"]["gpu"] in t4s and decision["choice"]["name"] == "GRID T4-1Q"


def test_a_scale_that_does_not_fit_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="--scale 200 is too large"):
        profiles.create(tmp_path / "big", "t4", scale=200)
    assert not (tmp_path / "big").exists()
