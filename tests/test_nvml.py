"""The NVML layer against a replay of a real H100, the simulated NVML, and NVML's error paths."""

from __future__ import annotations

import ctypes
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pynvml
import pytest

from vgpumgr.errors import Busy, Conflict, InvalidInput, NoCapacity
from vgpumgr.mig import plan as mig
from vgpumgr.nvidia.nvml import NvmlLayer
from vgpumgr.sim.nvml import SimNvml, create_state, write_state

FIXTURES = Path(__file__).parent / "fixtures" / "nvml"
REAL = json.loads((FIXTURES / "h100-real.json").read_text())
A100, H100, L40S = "0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0"


class ReplayNvml:
    """pynvml as it answered on the real H100 (passthrough, non-vGPU driver, MIG off)."""

    def __init__(self, recording: dict[str, Any]) -> None:
        self.rec = recording
        self.gpus = list(recording["gpus"].values())

    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)
        if name.startswith("nvml") and callable(value):  # every vGPU call: NotSupported on this driver
            def not_supported(*_a: Any, **_k: Any) -> Any:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return not_supported
        return value

    def _gpu(self, handle: int) -> dict[str, Any]:
        return self.gpus[handle]

    def nvmlInit(self) -> None:  # noqa: N802
        pass

    def nvmlShutdown(self) -> None:  # noqa: N802
        pass

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        return self.rec["driver"]["driver_version"]

    def nvmlSystemGetNVMLVersion(self) -> str:  # noqa: N802
        return self.rec["driver"]["nvml_version"]

    def nvmlSystemGetCudaDriverVersion(self) -> int:  # noqa: N802
        return self.rec["driver"]["cuda_driver_version"]

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:  # noqa: N802
        g = self._gpu(h)
        info = pynvml.nvmlPciInfo_t()
        info.busId = g["nvml_bus_id"].encode()
        vendor, device = (int(x, 16) for x in g["pci_id"].split(":"))
        sub_vendor, sub_device = (int(x, 16) for x in g["pci_subsystem_id"].split(":"))
        info.pciDeviceId, info.pciSubSystemId = device << 16 | vendor, sub_device << 16 | sub_vendor
        return info

    def nvmlDeviceGetName(self, h: int) -> str:  # noqa: N802
        return self._gpu(h)["name"]

    def nvmlDeviceGetUUID(self, h: int) -> str:  # noqa: N802
        return self._gpu(h)["uuid"]

    def nvmlDeviceGetSerial(self, h: int) -> str:  # noqa: N802
        return self._gpu(h)["serial"]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:  # noqa: N802
        m, mib = self._gpu(h)["memory"], 1024 * 1024
        out = pynvml.c_nvmlMemory_t()
        out.total, out.used, out.free = m["total_mb"] * mib, m["used_mb"] * mib, m["free_mb"] * mib
        return out

    def nvmlDeviceGetVirtualizationMode(self, h: int) -> int:  # noqa: N802
        return {"passthrough": 1}[self._gpu(h)["virtualization_mode"]]

    def nvmlDeviceGetMigMode(self, h: int) -> list[int]:  # noqa: N802
        mode = self._gpu(h)["mig"]
        return [int(mode["current"] == "enabled"), int(mode["pending"] == "enabled")]

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: int, enum: int, version: int = 2) -> Any:  # noqa: N802
        answer = self.rec["raw_profile_answers"][str(h)][str(enum)]
        if "error" in answer:
            raise pynvml.NVMLError(answer["error"])
        p = next(p for p in self._gpu(h)["mig"]["profiles"] if p["id"] == answer["id"])
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.id, info.sliceCount, info.instanceCount = p["id"], p["compute_slices"], p["max_instances"]
        info.multiprocessorCount, info.memorySizeMB = p["multiprocessors"], p["memory_mb"]
        info.copyEngineCount, info.decoderCount, info.encoderCount = p["copy_engines"], p["decoders"], p["encoders"]
        info.jpegCount, info.ofaCount, info.name = p["jpegs"], p["ofas"], p["display_name"].encode()
        return info

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, h: int, pid: int, array: Any, count: Any) -> int:  # noqa: N802
        placements = next(p for p in self._gpu(h)["mig"]["profiles"] if p["id"] == pid)["placements"]
        if array is not None:
            if len(array) < len(placements):  # what the real library would overrun
                raise AssertionError("placement array too small")
            for i, pl in enumerate(placements):
                array[i].start, array[i].size = pl["start"], pl["size"]
        count._obj.value = len(placements)
        return 0


def lgipp_table(text: str) -> dict[int, tuple[list[int], int]]:
    """`nvidia-smi mig -lgipp` -> {profile id: (starts, size)}."""
    out = {}
    for m in re.finditer(r"Profile ID\s+(\d+) Placements?\s*: \{([\d,]+)\}:(\d+)", text):
        out[int(m[1])] = ([int(s) for s in m[2].split(",")], int(m[3]))
    return out


# -- the real H100, replayed ----------------------------------------------------------------------

def test_replayed_h100_reports_identity_memory_and_passthrough() -> None:
    gpus = NvmlLayer(ReplayNvml(REAL)).gpus()
    assert list(gpus) == ["0000:00:06.0"]  # NVML's 00000000:00:06.0 normalised to the sysfs form
    gpu = gpus["0000:00:06.0"]
    assert gpu["name"] == REAL["gpu_name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["uuid"].startswith("GPU-") and gpu["uuid"] == REAL["gpus"]["0000:00:06.0"]["uuid"]
    assert gpu["pci_id"] == "10de:2330" and gpu["pci_subsystem_id"] == "10de:16c1"
    assert gpu["memory"]["total_mb"] == 81559
    assert gpu["virtualization_mode"] == "passthrough"
    assert gpu["mig"]["supported"] and gpu["mig"]["current"] == gpu["mig"]["pending"] == "disabled"
    assert gpu["vgpu"] == {"supported_types": [], "creatable_type_ids": None, "heterogeneous_mode": None,
                           "scheduler": None, "mixed_size": {"capable": None, "mode": None, "types": {},
                                                                 "homogeneous_capable": None, "placements": None}}
    assert {"host_vgpu_mode", "supported_vgpu_types", "scheduler"} <= set(gpu["not_supported"])


def test_replayed_h100_profile_table_matches_nvidia_smi_and_the_known_table() -> None:
    gpu = NvmlLayer(ReplayNvml(REAL)).gpus()["0000:00:06.0"]
    profiles = gpu["mig"]["profiles"]
    smi = lgipp_table((FIXTURES / "h100-real-lgipp.txt").read_text())
    assert {p["id"]: ([pl["start"] for pl in p["placements"]], p["placements"][0]["size"]) for p in profiles} == smi
    by_name = {p["name"]: (p["id"], p["enum_index"]) for p in profiles}
    assert by_name == {"1g.10gb": (19, 0), "1g.10gb+me": (20, 7), "1g.20gb": (15, 9), "2g.20gb": (14, 1),
                       "3g.40gb": (9, 2), "4g.40gb": (5, 3), "7g.80gb": (0, 4)}
    recorded = mig.ProfileTable.from_json(profiles)
    known = mig.KNOWN_TABLES["h100-80gb"]
    assert recorded.memory_slices == known.memory_slices == 8
    assert sorted(recorded.profiles, key=lambda p: p.id) == sorted(known.profiles, key=lambda p: p.id)


def test_layer_output_is_json_ready_and_matches_the_recording() -> None:
    layer = NvmlLayer(ReplayNvml(REAL))
    expected = json.loads(json.dumps(REAL["gpus"]))
    for g in expected.values():  # recorded before vgpumgr asked for mixed-size facts: NVML's answer is unknown
        g["vgpu"]["mixed_size"] = {"capable": None, "mode": None, "types": {}, "homogeneous_capable": None,
                                   "placements": None}
    assert json.loads(json.dumps(layer.gpus())) == expected
    assert layer.driver()["driver_version"] == REAL["driver_version"]


# -- error paths -----------------------------------------------------------------------------------

def test_missing_library_gives_sysfs_only_and_one_notice(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    layer = NvmlLayer(SimNvml(tmp_path / "absent.json"))
    caplog.set_level("INFO", logger="vgpumgr.nvidia.nvml")
    assert layer.gpus() == {} and layer.gpus() == {}
    assert not layer.available
    assert "libnvidia-ml.so.1" in layer.notice and "sysfs only" in layer.notice
    assert sum("NVML facts unavailable" in r.message for r in caplog.records) == 1
    assert layer.driver() == {"available": False, "notice": layer.notice}


def test_missing_python_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    layer = NvmlLayer.system()
    assert layer.gpus() == {} and "nvidia-ml-py" in layer.notice


def test_importing_the_layer_does_not_import_pynvml() -> None:
    code = "import sys, vgpumgr.nvidia.nvml, vgpumgr.mig.plan; print('pynvml' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.fixture
def sim(tmp_path: Path) -> SimNvml:
    state = tmp_path / "nvml.json"
    create_state(state, [("a100-mig", A100), ("h100", H100), ("l40s", L40S)])
    return SimNvml(state)


def _edit(sim: SimNvml, index: int, **changes: Any) -> None:
    state = json.loads(sim.state_path.read_text())
    state["gpus"][index].update(changes)
    write_state(sim.state_path, state)


def test_not_supported_per_call_leaves_the_rest(sim: SimNvml) -> None:
    _edit(sim, 1, not_supported=["nvmlDeviceGetSerial", "nvmlDeviceGetMigMode", "nvmlDeviceGetMemoryInfo"])
    gpu = NvmlLayer(sim).gpus()[H100]
    assert gpu["serial"] is None and gpu["memory"] is None
    assert gpu["mig"] == {"supported": False, "current": None, "pending": None}
    assert gpu["uuid"].startswith("GPU-") and gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert {"serial", "mig_mode", "memory"} <= set(gpu["not_supported"])


def test_gpu_lost_before_and_during_the_scan(sim: SimNvml) -> None:
    class LosesTheH100MidScan(SimNvml):
        def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:  # noqa: N802
            if self.nvmlDeviceGetPciInfo(handle).bus == 0x5E:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            return super().nvmlDeviceGetMigMode(handle)

    gpus = NvmlLayer(LosesTheH100MidScan(sim.state_path)).gpus()
    assert gpus[H100]["lost"] and "dmesg" in gpus[H100]["error"] and "vgpu" not in gpus[H100]
    assert not gpus[A100].get("lost") and gpus[L40S]["vgpu"]["supported_types"]

    _edit(sim, 0, lost=True)  # lost before even its PCI address can be read: left out, others kept
    assert sorted(NvmlLayer(sim).gpus()) == [H100, L40S]


# -- the simulated NVML through the layer -----------------------------------------------------------

def test_sim_gpus_vgpu_types_and_modes(sim: SimNvml) -> None:
    gpus = NvmlLayer(sim).gpus()
    a100, h100, l40s = gpus[A100], gpus[H100], gpus[L40S]
    assert a100["nvml_bus_id"] == "00000000:3B:00.0" and a100["pci_id"] == "10de:20b5"
    assert a100["mig"]["current"] == "enabled" and h100["mig"]["current"] == "disabled"
    assert h100["pci_subsystem_id"] == "10de:16c1" and not l40s["mig"]["supported"]
    types = {t["name"]: t for t in h100["vgpu"]["supported_types"]}
    me = types["NVIDIA H100XM-1-10CME"]
    assert (me["id"], me["mig_profile"], me["gpu_instance_profile_id"], me["framebuffer_mb"]) == \
        (1130, "1g.10gb+me", 20, 9984)
    assert me["license"] == "NVIDIA-vComputeServer,9.0" and me["series"] == "C"
    q = next(t for t in l40s["vgpu"]["supported_types"] if t["name"] == "NVIDIA L40S-2Q")
    assert (q["id"], q["max_instances"], q["framebuffer_mb"], q["gpu_instance_profile_id"]) == (1148, 24, 2048, None)
    assert "Quadro-Virtual-DWS" in q["license"]
    assert l40s["vgpu"]["heterogeneous_mode"] is False and a100["vgpu"]["heterogeneous_mode"] is None
    # MIG off: time-sliced types only; MIG on without GIs: nothing creatable
    assert set(h100["vgpu"]["creatable_type_ids"]) == {t["id"] for t in types.values() if t["mig_profile"] is None}
    assert a100["vgpu"]["creatable_type_ids"] == []


def test_create_and_destroy_gpu_instances_seen_by_another_process(sim: SimNvml) -> None:
    layer = NvmlLayer(sim)
    first = layer.create_gpu_instance(A100, "3g.40gb")
    assert (first["start"], first["size"], first["profile_id"]) == (4, 4, 9)
    second = layer.create_gpu_instance(A100, "2g.20gb", start=2, compute_instance=True)
    assert second["compute_instances"] == [{"id": 0, "profile_id": 1, "start": 0, "size": 2}]
    code = ("import json, sys; from vgpumgr.nvidia.nvml import NvmlLayer; from vgpumgr.sim.nvml import SimNvml; "
            f"g = NvmlLayer(SimNvml(sys.argv[1])).gpu('{A100}'); print(json.dumps(g['mig']['gpu_instances']))")
    seen = json.loads(subprocess.run([sys.executable, "-c", code, str(sim.state_path)],
                                     capture_output=True, text=True, check=True).stdout)
    assert [(g["profile"], g["start"], len(g["compute_instances"])) for g in seen] == [("2g.20gb", 2, 1),
                                                                                       ("3g.40gb", 4, 0)]
    assert set(NvmlLayer(sim).gpu(A100)["vgpu"]["creatable_type_ids"]) == {700, 701}  # A100D-2-20C, 3-40C
    removed = layer.destroy_gpu_instance(A100, second["id"])
    assert removed["compute_instances"] == [0]
    assert [gi.start for gi in layer.gpu_instances(A100)] == [4]


def test_create_refusals(sim: SimNvml) -> None:
    layer = NvmlLayer(sim)
    with pytest.raises(Conflict, match="MIG mode is off"):
        layer.create_gpu_instance(H100, "1g.10gb")
    layer.create_gpu_instance(A100, "4g.40gb")
    with pytest.raises(NoCapacity, match="overlaps 4g.40gb"):
        layer.create_gpu_instance(A100, "2g.20gb", start=2)
    with pytest.raises(InvalidInput, match="cannot start"):
        layer.create_gpu_instance(A100, "3g.40gb", start=1)
    with pytest.raises(Conflict, match="no MIG profiles|not support"):
        layer.create_gpu_instance(L40S, "1g.10gb")


def test_sim_insists_on_byref_placements(sim: SimNvml) -> None:
    sim.nvmlInit()
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    placement = sim.c_nvmlGpuInstancePlacement_t()
    placement.start, placement.size = 0, 4
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 9, placement)
    gi = sim.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 9, ctypes.byref(placement))
    assert isinstance(gi, pynvml.c_nvmlGpuInstance_t) and sim.nvmlGpuInstanceGetInfo(gi).placement.start == 0
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        sim.nvmlDeviceGetFanSpeed(handle)


def test_mig_mode_changes_report_what_is_pending(sim: SimNvml) -> None:
    layer = NvmlLayer(sim)
    hopper = layer.set_mig_mode(H100, True)
    assert (hopper["current"], hopper["pending"], hopper["reset_required"]) == ("enabled", "enabled", False)
    layer.create_gpu_instance(H100, "7g.80gb")
    with pytest.raises(Busy):
        layer.set_mig_mode(H100, False)
    ampere = layer.set_mig_mode(A100, False)
    assert (ampere["current"], ampere["pending"], ampere["reset_required"]) == ("enabled", "disabled", True)
    assert "reset" in ampere["hint"]
    sim.reset_gpu(A100)
    assert NvmlLayer(sim).gpu(A100)["mig"]["current"] == "disabled"


def test_scheduler_get_and_set(sim: SimNvml) -> None:
    layer = NvmlLayer(sim)
    assert layer.scheduler(L40S)["policy"] == "best-effort"
    changed = layer.set_scheduler(L40S, "fixed-share", timeslice_ns=3_000_000)
    assert changed["before"]["policy"] == "best-effort"
    # the time slice reads 0 while no vGPU runs ("no active scheduling", nvml.h); the driver keeps the 3 ms
    assert (changed["after"]["policy"], changed["after"]["timeslice_ns"]) == ("fixed-share", 0)
    assert sim._load()["gpus"][2]["scheduler"]["timeslice_ns"] == 3_000_000
    assert NvmlLayer(sim).gpu(L40S)["vgpu"]["scheduler"]["policy"] == "fixed-share"
    with pytest.raises(InvalidInput, match="not a vGPU scheduler policy"):
        layer.set_scheduler(L40S, "round-robin")
    with pytest.raises(InvalidInput, match="outside"):
        layer.set_scheduler(L40S, "equal-share", timeslice_ns=999)
    with pytest.raises(InvalidInput):
        layer.set_scheduler(L40S, "best-effort", timeslice_ns=2_000_000)
    with pytest.raises(Conflict, match="no vGPU scheduler"):
        NvmlLayer(ReplayNvml(REAL)).set_scheduler("0000:00:06.0", "equal-share")
