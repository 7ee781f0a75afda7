"""A simulated NVML with pynvml's API surface, for a simulated root only.

`SimNvml(state_path)` behaves like the `pynvml` module for the calls vgpumgr makes: same function
names, pynvml's own NVMLError subclasses, ctypes structs and handle types, so `NvmlLayer` cannot tell
the difference. Placements must be passed `byref()` as with the real library. Whatever pynvml has that
is not simulated answers NVMLError_FunctionNotFound; constants and struct types come from pynvml.

State lives in one JSON file (`create_state` writes it) so separate processes see the same GPUs:

    {"version": 1, "driver_version": "...", "gpus": [
      {"profile": "a100-mig", "address": "0000:3b:00.0", "uuid": "GPU-...", "serial": "...",
       "mig_mode": [current, pending], "gpu_instances": [
         {"id": 1, "profile_id": 9, "start": 0, "size": 4,
          "compute_instances": [{"id": 0, "profile_id": 2, "start": 0, "size": 3}]}],
       "heterogeneous_mode": 0, "scheduler": {"policy": 1, "arr": 0, "timeslice_ns": 0},
       "lost": false, "not_supported": ["nvmlDeviceGetSerial"]}]}

Running vGPUs (`vgpu_instances`, what NVML reports once a VM opened its vGPU) are described in
`vgpumgr.sim.nvml_vgpus`. `lost` makes every call on that GPU answer GpuIsLost; `not_supported` lists
functions that answer NotSupported for it (error-path tests and demos).

Long because: it mirrors the part of pynvml's API surface that vgpumgr calls, function by function.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from vgpumgr import ids
from vgpumgr.mig import plan as mig
from vgpumgr.sim import catalog as _catalog
from vgpumgr.sim.nvml_migration import VgpuMigration
from vgpumgr.sim.nvml_placement import VgpuPlacements
from vgpumgr.sim.nvml_scheduler import DEFAULT as SCHEDULER_DEFAULT
from vgpumgr.sim.nvml_scheduler import VgpuScheduler
from vgpumgr.sim.nvml_telemetry import VgpuTelemetry
from vgpumgr.sim.nvml_vgpus import VgpuInstances

STATE_VERSION = 1
_LICENSE = {  # per series, from NVIDIA's ctrl2080gpu.h (docs/sources.md §9)
    "A": "GRID-Virtual-Apps,3.0",
    "B": "GRID-Virtual-PC,2.0;Quadro-Virtual-DWS,5.0;GRID-Virtual-WS,2.0;GRID-Virtual-WS-Ext,2.0",
    "C": "NVIDIA-vComputeServer,9.0",
    "Q": "Quadro-Virtual-DWS,5.0;GRID-Virtual-WS,2.0;GRID-Virtual-WS-Ext,2.0",
}
_CLASS = {"A": "NVS", "B": "NVS", "C": "Compute", "Q": "Quadro"}  # not known from a source (docs/sources.md §17)
_CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}  # NVML_COMPUTE_INSTANCE_PROFILE_* -> compute slices
_ARCH = {"a100-mig": 7, "a40": 7, "l40s": 8, "h100": 9, "rtx-pro-6000": 10, "t4": 6}  # NVML_DEVICE_ARCH_*


@dataclass(frozen=True)
class VgpuTypeSpec:
    id: int
    name: str
    framebuffer_mb: int
    max_instances: int
    gi_profile_id: int | None = None  # MIG-backed types only


@dataclass(frozen=True)
class GpuSpec:
    name: str
    pci_id: tuple[int, int]  # vendor, device
    subsystem: tuple[int, int]
    memory_mb: int
    mig_table: str | None  # key of vgpumgr.mig.plan.KNOWN_TABLES
    mig_default: tuple[int, int]
    reset_for_mig: bool  # Ampere: a MIG mode change stays pending until a GPU reset
    types: tuple[VgpuTypeSpec, ...]
    mig_persistent: bool = False  # Ampere keeps MIG mode in the InfoROM across reboots; Hopper+ loses it
    sriov: bool = True  # NVML's host vGPU mode: SR-IOV (Ampere and later) or not (Turing's mdev, the T4)
    gi_scheduler: bool = False  # a vGPU scheduler per GPU instance with MIG on (Blackwell GB20x: nvml.h)


def _timesliced(prefix: str, first_id: int, gbs: Sequence[int], series: str, total_gb: int) -> list[VgpuTypeSpec]:
    return [VgpuTypeSpec(first_id + i, f"{prefix}-{gb}{series}", gb * 1024, min(32, total_gb // gb))
            for i, gb in enumerate(gbs)]


def _mig_types(prefix: str, table: str, rows: Sequence[tuple[int, str]]) -> list[VgpuTypeSpec]:
    profiles = mig.KNOWN_TABLES[table]
    out = []
    for type_id, short in rows:
        name = f"{prefix}{short}"
        profile = profiles.find(mig.profile_for_type(name) or "")
        out.append(VgpuTypeSpec(type_id, name, profile.memory_mb, profile.max_instances, profile.id))
    return out


# Type IDs and their sources: docs/sources.md §6.2. H100 time-sliced IDs are not published and are
# fabricated in the 90000 range so nobody mistakes them for real ones (§17).
SIM_PROFILES: dict[str, GpuSpec] = {
    "a100-mig": GpuSpec(
        "NVIDIA A100 80GB PCIe", (0x10DE, 0x20B5), (0x10DE, 0x1533), 81920, "a100-80gb", (1, 1), True,
        tuple(_timesliced("GRID A100D", 692, (4, 8, 10, 16, 20, 40, 80), "C", 80)
              + _mig_types("GRID A100D-", "a100-80gb", ((699, "1-10C"), (700, "2-20C"), (701, "3-40C"),
                                                         (702, "4-40C"), (703, "7-80C"), (707, "1-10CME"),
                                                         (1054, "1-20C")))), mig_persistent=True),
    "h100": GpuSpec(
        "NVIDIA H100 80GB HBM3", (0x10DE, 0x2330), (0x10DE, 0x16C1), 81559, "h100-80gb", (0, 0), False,
        tuple(_timesliced("NVIDIA H100XM", 90001, (4, 5, 8, 10, 16, 20, 40, 80), "C", 80)
              + _mig_types("NVIDIA H100XM-", "h100-80gb", ((1130, "1-10CME"), (1131, "1-10C"), (1132, "1-20C"),
                                                            (1133, "2-20C"), (1134, "3-40C"), (1135, "4-40C"),
                                                            (1136, "7-80C"))))),
    # an A40 with NVML (not in the a40-sriov profile by default; tests of mixed-size mode on mdev add it)
    "a40": GpuSpec(
        "NVIDIA A40", (0x10DE, 0x2235), (0x10DE, 0x145A), 46068, None, (0, 0), False,
        tuple(_timesliced("NVIDIA A40", 555, (1, 2), "B", 48)
              + _timesliced("NVIDIA A40", 557, (1, 2, 3, 4, 6, 8, 12, 16, 24, 48), "Q", 48))),
    "l40s": GpuSpec(
        "NVIDIA L40S", (0x10DE, 0x26B9), (0x10DE, 0x1851), 46068, None, (0, 0), False,
        tuple(_timesliced("NVIDIA L40S", 1145, (1, 2), "B", 48)
              + _timesliced("NVIDIA L40S", 1147, (1, 2, 3, 4, 6, 8, 12, 16, 24, 48), "Q", 48)
              + _timesliced("NVIDIA L40S", 1157, (1, 2, 3, 4, 6, 8, 12, 16, 24, 48), "A", 48)
              + [VgpuTypeSpec(2164, "NVIDIA L40S-3B", 3072, 16)])),
    # Blackwell GB202, device 10de:2bb5, 97887 MiB (MIG: NVIDIA's MIG user guide). Its type IDs are not published:
    # fabricated in the 90000 range (§17); the subsystem ID is the simulator's choice
    "rtx-pro-6000": GpuSpec(
        "NVIDIA RTX PRO 6000 Blackwell Server Edition", (0x10DE, 0x2BB5), (0x10DE, 0x204E), 97887,
        "rtx-pro-6000-96gb", (0, 0), False,
        tuple(_timesliced("NVIDIA RTXPro6000BlackwellDC", 90101, (8, 24, 48, 96), "Q", 96)
              + _mig_types("NVIDIA RTXPro6000BlackwellDC-", "rtx-pro-6000-96gb",
                           ((90111, "1-24C"), (90112, "2-48C"), (90113, "4-96C")))), gi_scheduler=True),
    "t4": GpuSpec(  # the T4 of the `mixed` profile: Turing, no SR-IOV, no MIG; types from the sysfs catalogue
        "Tesla T4", (0x10DE, 0x1EB8), (0x10DE, 0x12A2), 15360, None, (0, 0), False,
        tuple(VgpuTypeSpec(t.id, t.name, t.framebuffer_mb, t.max_instance) for t in _catalog.T4), sriov=False),
}


def create_state(state_path: str | os.PathLike[str], gpus: Sequence[tuple[str, str]],
                 driver_version: str = "580.159.04") -> None:
    """Write a fresh state file: `gpus` is [(profile, pci address)], e.g. [("h100", "0000:3b:00.0")]."""
    entries = []
    for profile, address in gpus:
        if profile not in SIM_PROFILES:
            raise ValueError(f"unknown simulated GPU profile {profile!r}; known: {', '.join(SIM_PROFILES)}")
        address = ids.pci_address(address)
        spec = SIM_PROFILES[profile]
        entries.append({
            "profile": profile, "address": address,
            "uuid": f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, 'vgpumgr-sim:' + address)}",
            "serial": str(1320000000000 + int(address.replace(":", "").replace(".", ""), 16) % 10**9),
            "mig_mode": list(spec.mig_default), "gpu_instances": [], "heterogeneous_mode": 0,
            "scheduler": dict(SCHEDULER_DEFAULT), "lost": False, "not_supported": [],
        })
    _write(Path(state_path), {"version": STATE_VERSION, "driver_version": driver_version, "gpus": entries})


def reboot_state(state_path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """What a host reboot does to NVML's view: GPU and compute instances and heterogeneous mode are gone;
    a pending MIG mode takes effect (the reset happened); MIG mode survives only where the GPU keeps it
    (Ampere), on Hopper and newer it comes back off. Returns, per GPU address, what it lost."""
    path = Path(state_path)
    lost: dict[str, dict[str, Any]] = {}
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = json.loads(path.read_text(encoding="utf-8"))
        for gpu in state["gpus"]:
            spec = SIM_PROFILES[gpu["profile"]]
            before = list(gpu["mig_mode"])
            mode = before[1] if spec.mig_persistent else 0
            gpu["mig_mode"] = [mode, mode]
            lost[gpu["address"]] = {"gpu_instances": len(gpu["gpu_instances"]),
                                    "mig_mode": before, "mig_mode_after": [mode, mode],
                                    "heterogeneous_mode": gpu["heterogeneous_mode"],
                                    "scheduler": gpu.get("scheduler")}
            gpu["scheduler"] = dict(SCHEDULER_DEFAULT)  # NVML's scheduler setting does not persist
            gpu["gpu_instances"] = []
            gpu["heterogeneous_mode"] = 0
            gpu["vgpu_instances"] = []  # every VM is gone
        _write(path, state)
    return lost


def _write(path: Path, state: dict[str, Any]) -> None:
    """Replace the state file, then count a new generation (readers keep a parsed copy while both the count
    and the file's identity are unchanged: see SimNvml._load). Call it holding the state's lock."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    gen = _generation(path)
    gtmp = path.with_name(path.name + ".gen.tmp")
    gtmp.write_text(str((gen or 0) + 1))
    os.replace(gtmp, path.with_name(path.name + ".gen"))


def _generation(path: Path) -> int | None:
    try:
        return int(path.with_name(path.name + ".gen").read_text())
    except (OSError, ValueError):
        return None


def write_state(state_path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Replace the whole state (tests and tools that set up a GPU by hand), as every writer here does."""
    path = Path(state_path)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _write(path, state)


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _ptr(value: int, ctype: Any) -> Any:
    return ctypes.cast(ctypes.c_void_p(value), ctype)


def _addr(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _deref(ref: Any) -> Any:
    """What a byref() points at; anything else is the by-value mistake the real library punishes."""
    obj = getattr(ref, "_obj", None)
    if obj is None:
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return obj


class SimNvml(VgpuInstances, VgpuMigration, VgpuTelemetry, VgpuPlacements, VgpuScheduler):
    """Stands in for the `pynvml` module. Handles encode (gpu index, GI id, CI id) in the pointer value."""

    profiles = SIM_PROFILES

    def __init__(self, state_path: str | os.PathLike[str]) -> None:
        self.state_path = Path(state_path)
        self._state_file = str(self.state_path)
        self._gen_file = str(self.state_path.with_name(self.state_path.name + ".gen"))
        self._state: dict[str, Any] | None = None
        self._parsed_key: tuple[Any, ...] | None = None
        self.instances: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}  # of the parsed copy, by id

    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)  # constants, structs, NVMLError classes
        if name.startswith("nvml") and callable(value):
            def not_simulated(*_args: Any, **_kwargs: Any) -> Any:
                raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return not_simulated
        return value

    # -- state ----------------------------------------------------------------------------------
    def _key(self) -> tuple[Any, ...] | None:
        """The state's generation and the file's identity: unchanged, the parsed copy is still the state.
        (Plain os calls on prepared strings: every simulated NVML call pays this.)"""
        try:
            fd = os.open(self._gen_file, os.O_RDONLY)
            try:
                gen = os.read(fd, 32)
            finally:
                os.close(fd)
        except OSError:
            gen = b""
        try:
            st = os.stat(self._state_file)
        except OSError as exc:
            raise _err(pynvml.NVML_ERROR_GPU_NOT_FOUND) from exc
        return (gen, st.st_ino, st.st_size, st.st_mtime_ns) if gen.strip().isdigit() else None

    def _load(self) -> dict[str, Any]:
        """The state as the file has it now. Every NVML call reads it; a parsed copy is kept while the file is
        unchanged (a vGPU telemetry pass makes thousands of calls). Readers never change what it returns."""
        if self._state is None:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        key = self._key()
        if key is not None and key == self._parsed_key:
            return self._state
        try:
            self._state = json.loads(self.state_path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise _err(pynvml.NVML_ERROR_GPU_NOT_FOUND) from exc
        self._parsed_key = key
        self.instances = {i["id"]: (g, i) for g in self._state.get("gpus", ()) for i in g.get("vgpu_instances", ())}
        return self._state

    @contextmanager
    def _mutate(self) -> Iterator[dict[str, Any]]:
        lock_path = self.state_path.with_name(self.state_path.name + ".lock")
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._state is None:
                raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
            self._parsed_key = None  # a change starts from the file, never from a copy it may leave half-done
            state = self._load()
            self._parsed_key = None
            yield state
            _write(self.state_path, state)

    def _gpu(self, state: dict[str, Any], handle: Any, call: str) -> tuple[dict[str, Any], GpuSpec]:
        index = (_addr(handle) >> 16) - 1
        if not 0 <= index < len(state["gpus"]):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = state["gpus"][index]
        if gpu.get("lost"):
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        if call in gpu.get("not_supported", ()):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu, SIM_PROFILES[gpu["profile"]]

    def _read(self, handle: Any, call: str) -> tuple[dict[str, Any], GpuSpec]:
        return self._gpu(self._load(), handle, call)

    def _table(self, spec: GpuSpec) -> mig.ProfileTable:
        if spec.mig_table is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return mig.KNOWN_TABLES[spec.mig_table]

    @staticmethod
    def _gi(gpu: dict[str, Any], handle: Any) -> dict[str, Any]:
        gi_id = ((_addr(handle) >> 8) & 0xFF) - 1
        found = next((g for g in gpu["gpu_instances"] if g["id"] == gi_id), None)
        if found is None:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return found

    # -- library -------------------------------------------------------------------------------
    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        if not self.state_path.is_file():
            raise _err(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        self._state, self._parsed_key = {}, None
        self._load()

    def nvmlShutdown(self) -> None:  # noqa: N802
        self._state, self._parsed_key = None, None

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        return self._load()["driver_version"]

    def nvmlSystemGetNVMLVersion(self) -> str:  # noqa: N802
        return "13." + self._load()["driver_version"]

    def nvmlSystemGetCudaDriverVersion(self) -> int:  # noqa: N802
        self._load()
        return 13000

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self._load()["gpus"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:  # noqa: N802
        if not 0 <= index < len(self._load()["gpus"]):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _ptr((index + 1) << 16, pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str | bytes) -> Any:  # noqa: N802
        text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
        for index, gpu in enumerate(self._load()["gpus"]):
            if ids.is_pci_address(text) and gpu["address"] == ids.pci_address(text):
                return self.nvmlDeviceGetHandleByIndex(index)
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    # -- device facts --------------------------------------------------------------------------
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:  # noqa: N802
        gpu, spec = self._read(handle, "nvmlDeviceGetPciInfo")
        domain, bus, rest = gpu["address"].split(":")
        slot, function = rest.split(".")
        info = pynvml.nvmlPciInfo_t()
        info.busId = f"{int(domain, 16):08X}:{bus.upper()}:{slot.upper()}.{function}".encode()
        info.busIdLegacy = f"{int(domain, 16):04X}:{bus.upper()}:{slot.upper()}.{function}".encode()
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(slot, 16)
        info.pciDeviceId = spec.pci_id[1] << 16 | spec.pci_id[0]
        info.pciSubSystemId = spec.subsystem[1] << 16 | spec.subsystem[0]
        return info

    def nvmlDeviceGetName(self, handle: Any) -> str:  # noqa: N802
        return self._read(handle, "nvmlDeviceGetName")[1].name

    def nvmlDeviceGetArchitecture(self, handle: Any) -> int:  # noqa: N802
        return _ARCH[self._read(handle, "nvmlDeviceGetArchitecture")[0]["profile"]]

    def nvmlDeviceGetUUID(self, handle: Any) -> str:  # noqa: N802
        return self._read(handle, "nvmlDeviceGetUUID")[0]["uuid"]

    def nvmlDeviceGetSerial(self, handle: Any) -> str:  # noqa: N802
        return self._read(handle, "nvmlDeviceGetSerial")[0]["serial"]

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:  # noqa: N802
        _gpu, spec = self._read(handle, "nvmlDeviceGetMemoryInfo")
        memory = pynvml.c_nvmlMemory_t()
        memory.total = spec.memory_mb * 1024 * 1024
        memory.used = 480 * 1024 * 1024
        memory.free = memory.total - memory.used
        return memory

    def nvmlDeviceGetVirtualizationMode(self, handle: Any) -> int:  # noqa: N802
        self._read(handle, "nvmlDeviceGetVirtualizationMode")
        return pynvml.NVML_GPU_VIRTUALIZATION_MODE_HOST_VGPU

    def nvmlDeviceGetHostVgpuMode(self, handle: Any) -> int:  # noqa: N802
        return int(self._read(handle, "nvmlDeviceGetHostVgpuMode")[1].sriov)  # 1 SR-IOV, 0 not (the T4)

    # -- MIG -----------------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:  # noqa: N802
        gpu, spec = self._read(handle, "nvmlDeviceGetMigMode")
        self._table(spec)
        return list(gpu["mig_mode"])

    def nvmlDeviceSetMigMode(self, handle: Any, mode: int) -> int:  # noqa: N802
        with self._mutate() as state:
            gpu, spec = self._gpu(state, handle, "nvmlDeviceSetMigMode")
            self._table(spec)
            if not mode and gpu["gpu_instances"]:
                raise _err(pynvml.NVML_ERROR_IN_USE)
            gpu["mig_mode"] = [gpu["mig_mode"][0] if spec.reset_for_mig else int(bool(mode)), int(bool(mode))]
        return pynvml.NVML_SUCCESS

    def reset_gpu(self, address: str) -> None:
        """What `nvidia-smi -r` does to the simulated GPU: a pending MIG mode takes effect."""
        with self._mutate() as state:
            gpu = next(g for g in state["gpus"] if g["address"] == ids.pci_address(address))
            gpu["mig_mode"][0] = gpu["mig_mode"][1]
            gpu["gpu_instances"] = []

    def _profile(self, spec: GpuSpec, profile_id: int) -> mig.Profile:
        profile = self._table(spec).by_id(profile_id)
        if profile is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return profile

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, enum: int, version: int = 2) -> Any:  # noqa: N802
        _gpu, spec = self._read(handle, "nvmlDeviceGetGpuInstanceProfileInfo")
        if enum >= pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT - 1:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        p = next((p for p in self._table(spec).profiles if p.enum_index == enum), None)
        if p is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2 else pynvml.c_nvmlGpuInstanceProfileInfo_t()
        me = p.name.endswith("+me")
        info.id, info.sliceCount, info.instanceCount = p.id, p.compute_slices, p.max_instances
        info.multiprocessorCount, info.memorySizeMB = p.multiprocessors or 0, p.memory_mb
        info.copyEngineCount = info.decoderCount = info.jpegCount = p.compute_slices
        info.ofaCount = int(me or p.compute_slices == 7)
        if version == 2:
            info.name = f"MIG {p.name}".encode()
        return info

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, handle: Any, profile_id: int, placements: Any,  # noqa: N802
                                                   count_ref: Any) -> int:
        _gpu, spec = self._read(handle, "nvmlDeviceGetGpuInstancePossiblePlacements")
        profile = self._profile(spec, profile_id)
        count = _deref(count_ref)
        if placements is not None:
            if len(placements) < len(profile.starts):
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
            for i, start in enumerate(profile.starts):
                placements[i].start, placements[i].size = start, profile.size
        count.value = len(profile.starts)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, handle: Any, profile_id: int) -> int:  # noqa: N802
        gpu, spec = self._read(handle, "nvmlDeviceGetGpuInstanceRemainingCapacity")
        table, profile = self._table(spec), self._profile(spec, profile_id)
        layout, added = _placed(gpu), 0
        while (start := mig.best_start(table, layout, profile)) is not None:
            layout.append(mig.Placed(profile.id, start, profile.size))
            added += 1
        return added

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: Any, profile_id: int,  # noqa: N802
                                                 placement_ref: Any) -> Any:
        placement = _deref(placement_ref)
        return self._create_gi(handle, profile_id, placement.start, placement.size)

    def nvmlDeviceCreateGpuInstance(self, handle: Any, profile_id: int) -> Any:  # noqa: N802
        return self._create_gi(handle, profile_id, None, None)

    def _create_gi(self, handle: Any, profile_id: int, start: int | None, size: int | None) -> Any:
        with self._mutate() as state:
            gpu, spec = self._gpu(state, handle, "nvmlDeviceCreateGpuInstance")
            table, profile = self._table(spec), self._profile(spec, profile_id)
            if not gpu["mig_mode"][0]:
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            layout = _placed(gpu)
            if start is None:
                start = mig.best_start(table, layout, profile)
                if start is None:
                    raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            elif size != profile.size or start not in profile.starts:
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            elif mig.placement_problem(table, layout, profile, start):
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            gi_id = next(i for i in range(1, 64) if all(g["id"] != i for g in gpu["gpu_instances"]))
            gpu["gpu_instances"].append({"id": gi_id, "profile_id": profile.id, "start": start,
                                         "size": profile.size, "compute_instances": []})
        return _ptr(_addr(handle) | (gi_id + 1) << 8, pynvml.c_nvmlGpuInstance_t)

    def nvmlDeviceGetGpuInstances(self, handle: Any, profile_id: int, array: Any, count_ref: Any) -> int:  # noqa: N802
        gpu, spec = self._read(handle, "nvmlDeviceGetGpuInstances")
        self._profile(spec, profile_id)
        mine = [g for g in gpu["gpu_instances"] if g["profile_id"] == profile_id]
        if len(array) < len(mine):
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, gi in enumerate(mine):
            array[i] = _ptr(_addr(handle) | (gi["id"] + 1) << 8, pynvml.c_nvmlGpuInstance_t)
        _deref(count_ref).value = len(mine)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gi_id: int) -> Any:  # noqa: N802
        gpu, _spec = self._read(handle, "nvmlDeviceGetGpuInstanceById")
        found = _ptr(_addr(handle) | (gi_id + 1) << 8, pynvml.c_nvmlGpuInstance_t)
        self._gi(gpu, found)
        return found

    def nvmlGpuInstanceGetInfo(self, gi_handle: Any) -> Any:  # noqa: N802
        gpu, _spec = self._read(gi_handle, "nvmlGpuInstanceGetInfo")
        gi = self._gi(gpu, gi_handle)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = _ptr(_addr(gi_handle) & ~0xFFFF, pynvml.c_nvmlDevice_t)
        info.id, info.profileId = gi["id"], gi["profile_id"]
        info.placement.start, info.placement.size = gi["start"], gi["size"]
        return info

    def nvmlGpuInstanceDestroy(self, gi_handle: Any) -> int:  # noqa: N802
        with self._mutate() as state:
            gpu, _spec = self._gpu(state, gi_handle, "nvmlGpuInstanceDestroy")
            gi = self._gi(gpu, gi_handle)
            if gi["compute_instances"]:
                raise _err(pynvml.NVML_ERROR_IN_USE)
            gpu["gpu_instances"].remove(gi)
        return pynvml.NVML_SUCCESS

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi_handle: Any, enum: int, engine: int,  # noqa: N802
                                                     version: int = 2) -> Any:
        gpu, spec = self._read(gi_handle, "nvmlGpuInstanceGetComputeInstanceProfileInfo")
        gi_slices = self._profile(spec, self._gi(gpu, gi_handle)["profile_id"]).compute_slices
        slices = _CI_SLICES.get(enum)
        if slices is None or slices > gi_slices or engine != 0:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = (pynvml.c_nvmlComputeInstanceProfileInfo_v2_t() if version == 2
                else pynvml.c_nvmlComputeInstanceProfileInfo_t())
        info.id, info.sliceCount, info.instanceCount = enum, slices, gi_slices // slices
        if version == 2:
            info.name = f"{slices}c.{gi_slices}g".encode()
        return info

    def nvmlGpuInstanceCreateComputeInstance(self, gi_handle: Any, ci_profile_id: int) -> Any:  # noqa: N802
        with self._mutate() as state:
            gpu, spec = self._gpu(state, gi_handle, "nvmlGpuInstanceCreateComputeInstance")
            gi = self._gi(gpu, gi_handle)
            gi_slices = self._profile(spec, gi["profile_id"]).compute_slices
            slices = _CI_SLICES.get(ci_profile_id)
            if slices is None or slices > gi_slices:
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            used = sum(c["size"] for c in gi["compute_instances"])
            if used + slices > gi_slices:
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            ci_id = next(i for i in range(64) if all(c["id"] != i for c in gi["compute_instances"]))
            gi["compute_instances"].append({"id": ci_id, "profile_id": ci_profile_id, "start": used, "size": slices})
        return _ptr(_addr(gi_handle) | (ci_id + 1), pynvml.c_nvmlComputeInstance_t)

    def nvmlGpuInstanceGetComputeInstances(self, gi_handle: Any, ci_profile_id: int, array: Any,  # noqa: N802
                                           count_ref: Any) -> int:
        gpu, _spec = self._read(gi_handle, "nvmlGpuInstanceGetComputeInstances")
        mine = [c for c in self._gi(gpu, gi_handle)["compute_instances"] if c["profile_id"] == ci_profile_id]
        if len(array) < len(mine):
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, ci in enumerate(mine):
            array[i] = _ptr(_addr(gi_handle) | (ci["id"] + 1), pynvml.c_nvmlComputeInstance_t)
        _deref(count_ref).value = len(mine)
        return pynvml.NVML_SUCCESS

    def _ci(self, gpu: dict[str, Any], ci_handle: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        gi = self._gi(gpu, ci_handle)
        ci_id = (_addr(ci_handle) & 0xFF) - 1
        found = next((c for c in gi["compute_instances"] if c["id"] == ci_id), None)
        if found is None:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return gi, found

    def nvmlComputeInstanceGetInfo(self, ci_handle: Any) -> Any:  # noqa: N802
        gpu, _spec = self._read(ci_handle, "nvmlComputeInstanceGetInfo")
        _gi, ci = self._ci(gpu, ci_handle)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.id, info.profileId = ci["id"], ci["profile_id"]
        info.placement.start, info.placement.size = ci["start"], ci["size"]
        return info

    def nvmlComputeInstanceDestroy(self, ci_handle: Any) -> int:  # noqa: N802
        with self._mutate() as state:
            gpu, _spec = self._gpu(state, ci_handle, "nvmlComputeInstanceDestroy")
            gi, ci = self._ci(gpu, ci_handle)
            gi["compute_instances"].remove(ci)
        return pynvml.NVML_SUCCESS

    # -- vGPU types, modes, scheduler -------------------------------------------------------------
    def nvmlDeviceGetSupportedVgpus(self, handle: Any) -> list[int]:  # noqa: N802
        return [t.id for t in self._read(handle, "nvmlDeviceGetSupportedVgpus")[1].types]

    def nvmlDeviceGetCreatableVgpus(self, handle: Any) -> list[int]:  # noqa: N802
        """MIG on: MIG-backed types whose GI profile has a GI; MIG off: time-sliced types (vGPUs that
        exist in the simulated sysfs are not seen here)."""
        gpu, spec = self._read(handle, "nvmlDeviceGetCreatableVgpus")
        if spec.mig_table and gpu["mig_mode"][0]:
            have = {g["profile_id"] for g in gpu["gpu_instances"]}
            return [t.id for t in spec.types if t.gi_profile_id in have]
        return [t.id for t in spec.types if t.gi_profile_id is None]

    def _type(self, type_id: int) -> VgpuTypeSpec:
        self._load()
        for spec in SIM_PROFILES.values():
            for t in spec.types:
                if t.id == type_id:
                    return t
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _series(self, type_id: int) -> str:
        parsed = ids.parse_type_name(self._type(type_id).name)
        return parsed.series if parsed else "Q"

    def nvmlVgpuTypeGetName(self, type_id: int) -> str:  # noqa: N802
        return self._type(type_id).name

    def nvmlVgpuTypeGetClass(self, type_id: int) -> str:  # noqa: N802
        return _CLASS[self._series(type_id)]

    def nvmlVgpuTypeGetLicense(self, type_id: int) -> str:  # noqa: N802
        return _LICENSE[self._series(type_id)]

    def nvmlVgpuTypeGetFramebufferSize(self, type_id: int) -> int:  # noqa: N802
        return self._type(type_id).framebuffer_mb * 1024 * 1024

    def nvmlVgpuTypeGetMaxInstances(self, handle: Any, type_id: int) -> int:  # noqa: N802
        self._read(handle, "nvmlVgpuTypeGetMaxInstances")
        return self._type(type_id).max_instances

    def nvmlVgpuTypeGetGpuInstanceProfileId(self, type_id: int) -> int:  # noqa: N802
        gi = self._type(type_id).gi_profile_id
        return 0xFFFFFFFF if gi is None else gi

    # nvmlDevice{Get,Set}VgpuHeterogeneousMode and the placement calls: vgpumgr.sim.nvml_placement


def _placed(gpu: dict[str, Any]) -> list[mig.Placed]:
    return [mig.Placed(g["profile_id"], g["start"], g["size"], g["id"]) for g in gpu["gpu_instances"]]
