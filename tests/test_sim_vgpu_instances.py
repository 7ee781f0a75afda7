"""Running vGPUs in the simulated NVML (what NVML reports once a VM opened its vGPU) and NVIDIA's
migration rules (vgpumgr.nvidia.compat)."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from vgpumgr.config import Config
from vgpumgr.nvidia import compat
from vgpumgr.service import Service
from vgpumgr.sim import guests, nvml_vgpus, profiles
from vgpumgr.sim.reboot import reboot as sim_reboot

VM_A = "6f1c1a2e-0000-4000-8000-00000000000a"
VM_B = "6f1c1a2e-0000-4000-8000-00000000000b"


def service(tmp_path: Path, profile: str) -> Service:
    root = profiles.create(tmp_path / "sim", profile)
    cfg = Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "state"), connect="test:///default")
    return Service(cfg, licence_mode="off")


def test_a_guest_on_a_vendor_vf_is_an_active_vgpu_until_it_stops(tmp_path: Path) -> None:
    svc = service(tmp_path, "l40s-vfio")
    a = svc.allocate("L40S-2Q", vm="a")
    nvml = svc.host.kernel.nvml_library()
    nvml.nvmlInit()
    gpu = nvml.nvmlDeviceGetHandleByPciBusId(a["gpu"])
    assert nvml.nvmlDeviceGetActiveVgpus(gpu) == []

    inst = guests.start(svc.host.root, a["pci_address"], vm_uuid=VM_A, vm_name="a")
    assert nvml.nvmlDeviceGetActiveVgpus(gpu) == [inst["id"]]
    assert nvml.nvmlVgpuInstanceGetVmID(inst["id"]) == (VM_A, pynvml.NVML_VGPU_VM_ID_UUID)
    assert nvml.nvmlVgpuTypeGetName(nvml.nvmlVgpuInstanceGetType(inst["id"])) == "NVIDIA L40S-2Q"
    assert nvml.nvmlVgpuInstanceGetMdevUUID(inst["id"]) == ""
    assert nvml.nvmlVgpuInstanceGetGpuInstanceId(inst["id"]) == nvml_vgpus.INVALID_GI
    assert nvml.nvmlVgpuInstanceGetVmDriverVersion(inst["id"]) == "Not Available"
    with pytest.raises(ValueError, match="already runs"):
        guests.start(svc.host.root, a["pci_address"], vm_uuid=VM_B)

    assert guests.stop(svc.host.root, a["pci_address"])["id"] == inst["id"]
    assert nvml.nvmlDeviceGetActiveVgpus(gpu) == []
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlVgpuInstanceGetVmID(inst["id"])


def test_a_mig_backed_guest_runs_on_its_own_gpu_instance_and_a_reboot_ends_every_guest(tmp_path: Path) -> None:
    svc = service(tmp_path, "a100-mig")
    first, second = svc.allocate_mig("1g.10gb", vm="a"), svc.allocate_mig("1g.10gb", vm="b")
    one = guests.start(svc.host.root, first["uuid"], vm_uuid=VM_A, guest_driver="580.95.05")
    two = guests.start(svc.host.root, second["uuid"], vm_uuid=VM_B)
    assert one["mdev_uuid"] == first["uuid"] and one["vf"] == first["parent"]
    assert one["gi_id"] is not None and two["gi_id"] is not None and one["gi_id"] != two["gi_id"]
    nvml = svc.host.kernel.nvml_library()
    nvml.nvmlInit()
    assert nvml.nvmlVgpuInstanceGetMdevUUID(one["id"]) == first["uuid"]
    assert nvml.nvmlVgpuInstanceGetVmDriverVersion(one["id"]) == "580.95.05"
    assert {i["id"] for i in guests.running(svc.host.root)} == {one["id"], two["id"]}

    sim_reboot(svc.host.root)
    assert guests.running(svc.host.root) == []


def test_a_guest_needs_an_existing_vgpu_and_a_gpu_with_nvml(tmp_path: Path) -> None:
    svc = service(tmp_path, "l40s-vfio")
    with pytest.raises(ValueError, match="holds no vGPU type"):
        guests.start(svc.host.root, "0000:3d:00.4", vm_uuid=VM_A)
    with pytest.raises(ValueError, match="no NVIDIA mdev"):
        guests.start(svc.host.root, VM_B, vm_uuid=VM_A)
    t4 = service(tmp_path / "t4", "t4")
    with pytest.raises(ValueError, match="no simulated NVML"):
        guests.start(t4.host.root, t4.allocate("T4-4Q", vm="a")["uuid"], vm_uuid=VM_A)


SRC = compat.MigratingVgpu("NVIDIA L40S-4Q", device_id="26b9", gpu_name="NVIDIA L40S", host_driver="580.95.02",
                           guest_driver="580.95.05", guest_vgpu_version=0x120001)


def dst(**kw: object) -> compat.CandidateGpu:
    base = {"address": "0000:3d:00.0", "device_id": "26b9", "gpu_name": "NVIDIA L40S", "host_driver": "580.95.02",
            "vgpu_range": (0x110001, 0x120001)}
    return compat.CandidateGpu(**(base | kw))  # type: ignore[arg-type]


def test_the_same_type_board_and_vgpu_manager_migrate_live() -> None:
    verdict = compat.live_migration(SRC, dst(), offered_type="L40S-4Q")
    assert verdict == compat.Verdict(True, compat.LIMIT_NONE, "")


@pytest.mark.parametrize(("candidate", "offered", "limit", "words"), [
    (dst(), None, compat.LIMIT_TYPE, "does not offer vGPU type NVIDIA L40S-4Q"),
    (dst(), "L40S-2Q", compat.LIMIT_TYPE, "keeps its type"),
    (dst(device_id="26b5", gpu_name="NVIDIA L40"), "L40S-4Q", compat.LIMIT_GPU, "another board"),
    (dst(host_driver="570.172.07"), "L40S-4Q", compat.LIMIT_HOST_DRIVER, "570.172.07"),
    (dst(vgpu_range=(0x110001, 0x110005)), "L40S-4Q", compat.LIMIT_GUEST_DRIVER, "outside"),
])
def test_each_rule_refuses_with_its_limit_and_reason(candidate: compat.CandidateGpu, offered: str | None,
                                                     limit: str, words: str) -> None:
    verdict = compat.live_migration(SRC, candidate, offered_type=offered)
    assert not verdict.live and verdict.limit == limit and words in verdict.reason


def test_unknown_facts_do_not_refuse_but_nvml_answers_are_read_bit_by_bit() -> None:
    bare = compat.MigratingVgpu("L40S-4Q")
    assert compat.live_migration(bare, dst(host_driver=None, device_id=None), offered_type="NVIDIA L40S-4Q").live
    assert compat.from_nvml(0x8 | 0x1, 0).live
    refused = compat.from_nvml(0x1, 0x4)
    assert (refused.live, refused.limit, refused.source) == (False, compat.LIMIT_GPU, "nvml")
    assert compat.from_nvml(0, 0).limit == compat.LIMIT_OTHER


def test_on_the_real_h100_in_passthrough_the_vgpu_calls_are_absent_and_the_rules_decide() -> None:
    """Replays what NVML answered on the lent H100 (driver 580.159.04, no vGPU manager, MIG off;
    tests/fixtures/nvml/h100-vgpu.json, written by scripts/nvml_vgpu_check.py)."""
    import json
    from pathlib import Path

    from test_nvml import REAL, ReplayNvml

    from vgpumgr.nvidia import migration as nvml_migration
    from vgpumgr.nvidia.nvml import NvmlLayer

    rec = json.loads((Path(__file__).parent / "fixtures/nvml/h100-vgpu.json").read_text())
    [(address, gpu)] = rec["gpus"].items()
    assert {fn for fn, a in gpu["raw"].items() if a.get("error") == pynvml.NVML_ERROR_NOT_SUPPORTED} >= {
        "nvmlDeviceGetActiveVgpus", "nvmlDeviceGetVgpuMetadata", "nvmlDeviceGetVgpuInstancesUtilizationInfo"}
    rng = [int(x) for x in rec["system"]["nvmlGetVgpuVersion"]["value"][0].strip("()").split(",")]

    class H100(ReplayNvml):
        def nvmlGetVgpuVersion(self) -> list[tuple[int, int]]:  # noqa: N802 - answered there, even without vGPU
            return [tuple(rng), tuple(rng)]

    layer = NvmlLayer(H100(REAL))
    facts = nvml_migration.source_facts(layer, address, vm_uuid=VM_A, type_id=1131)
    assert facts["nvml"].endswith("Not Supported") and facts["host_driver"] == REAL["driver_version"]
    cand = nvml_migration.candidate(layer, address, "2330", "NVIDIA H100 80GB HBM3")
    assert cand.vgpu_range == tuple(rng) == (0x120001, 0x1A0001)
    vgpu = compat.MigratingVgpu("NVIDIA H100XM-1-10C", device_id="2330", host_driver=REAL["driver_version"])
    verdict = nvml_migration.verdict(layer, cand, vgpu, "NVIDIA H100XM-1-10C", "AAAA")
    assert verdict.live and verdict.source == "rules" and verdict.note
    assert gpu["verdict_without_metadata"]["source"] == "rules"
