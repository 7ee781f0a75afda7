"""Facts NVML knows and sysfs does not, and the few NVML writes vgpumgr makes (MIG, scheduler).

`NvmlLayer(module)` takes a pynvml-compatible module: `pynvml` itself (`NvmlLayer.system()` imports it
lazily), the simulated NVML of a simulated root, or a test fake. It works in three worlds:
NVML missing (no GPUs reported, one `notice` saying so), calls that answer NotSupported (a passthrough
or non-vGPU driver: the field is None and its name is listed in `not_supported`), and a vGPU host.

Long because: it is the one adapter over NVML's flat C API (device facts, vGPU catalogue, MIG profiles,
placements and instances, scheduler), each call wrapped for the three worlds above.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from vgpumgr import ids
from vgpumgr.errors import (
    Busy,
    Conflict,
    InvalidInput,
    KernelError,
    NoCapacity,
    NotFound,
    PermissionDenied,
    Unavailable,
    VgpuError,
)
from vgpumgr.mig import plan as mig
from vgpumgr.nvidia import mixed as nvml_mixed

log = logging.getLogger(__name__)

VIRTUALIZATION_MODES = {0: "none", 1: "passthrough", 2: "vgpu", 3: "host-vgpu", 4: "host-vsga"}
HOST_VGPU_MODES = {0: "non-sriov", 1: "sriov"}
SCHEDULER_POLICIES = {0: "unknown", 1: "best-effort", 2: "equal-share", 3: "fixed-share"}
INVALID_PROFILE_ID = 0xFFFFFFFF
_MIB = 1024 * 1024

# NVML return codes (nvml.h); compared by value so a fake module needs only NVMLError.value
_NOT_SUPPORTED, _NO_PERMISSION, _NOT_FOUND, _FUNCTION_NOT_FOUND, _GPU_IS_LOST = 3, 4, 6, 13, 15
_INVALID_ARGUMENT, _RESET_REQUIRED, _IN_USE, _INSUFFICIENT_RESOURCES = 2, 16, 19, 23
_ARGUMENT_VERSION_MISMATCH = 25
_ABSENT = {_NOT_SUPPORTED, _FUNCTION_NOT_FOUND, _NOT_FOUND, _INVALID_ARGUMENT, _ARGUMENT_VERSION_MISMATCH}
_LIBRARY_ERRORS = {
    1: "NVML is not initialised",
    9: "the NVIDIA kernel driver is not loaded",
    12: "the NVML library (libnvidia-ml.so.1) is not installed",
    18: "the NVML library and the kernel driver versions differ (reboot after a driver update?)",
}


class _GpuLost(Exception):
    pass


class NvmlLayer:
    def __init__(self, nvml_module: Any | None, notice: str | None = None) -> None:
        self.nvml = nvml_module
        self.notice = notice  # one line for the user when NVML cannot be used at all
        self._opened = False
        self._addresses: dict[str, int] = {}
        # NVML calls this driver answered FunctionNotFound (its library predates them; vgpumgr.nvidia.sched_fields):
        # asked once per driver, not on every read; forgotten at close (a driver reload may bring them)
        self.missing_calls: set[str] = set()

    @classmethod
    def system(cls) -> NvmlLayer:
        """The real NVML through pynvml, imported only now (the CLI start path stays fast)."""
        try:
            import pynvml
        except ImportError:
            return cls(None, notice="NVML facts unavailable: the Python package nvidia-ml-py is not "
                                    "installed; using sysfs only")
        return cls(pynvml)

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self.open()

    def open(self) -> bool:
        """Initialise NVML once; False (and `notice` set, logged once) when it cannot be used."""
        if self._opened:
            return True
        if self.nvml is None:
            return False
        try:
            self.nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - any failure here means "sysfs only"
            code = getattr(exc, "value", None)
            why = _LIBRARY_ERRORS.get(code, f"NVML could not start ({exc})") if code is not None else str(exc)
            if self.notice is None:
                self.notice = f"NVML facts unavailable: {why}; using sysfs only"
                log.info(self.notice)
            self.nvml = None
            return False
        self._opened = True
        return True

    def close(self) -> None:
        if self._opened:
            self._opened = False
            self.missing_calls.clear()
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - nothing useful to do on shutdown
                pass

    def __enter__(self) -> NvmlLayer:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- read -----------------------------------------------------------------------------------
    def driver(self) -> dict[str, Any]:
        if not self.open():
            return {"available": False, "notice": self.notice}
        absent: list[str] = []
        out: dict[str, Any] = {"available": True}
        out["driver_version"] = self._try(absent, "driver_version", self.nvml.nvmlSystemGetDriverVersion)
        out["nvml_version"] = self._try(absent, "nvml_version", self.nvml.nvmlSystemGetNVMLVersion)
        out["cuda_driver_version"] = self._try(absent, "cuda_driver_version",
                                               self.nvml.nvmlSystemGetCudaDriverVersion)
        out["not_supported"] = absent
        return out

    def gpus(self) -> dict[str, dict[str, Any]]:
        """Every GPU NVML sees, keyed by sysfs PCI address; {} when NVML is unavailable."""
        if not self.open():
            return {}
        out: dict[str, dict[str, Any]] = {}
        self._addresses = {}
        try:
            count = self.nvml.nvmlDeviceGetCount()
        except self.nvml.NVMLError as exc:
            self.notice = f"NVML could not count GPUs ({exc}); using sysfs only"
            return {}
        for index in range(count):
            entry = self._read_gpu(index)
            if entry is not None:
                out[entry["address"]] = entry
                self._addresses[entry["address"]] = index
        return out

    def gpu(self, address: str) -> dict[str, Any]:
        address = ids.pci_address(address)
        return self._read_gpu(self._index(address)) or {"address": address, "lost": True}

    def _read_gpu(self, index: int) -> dict[str, Any] | None:
        n = self.nvml
        absent: list[str] = []
        try:
            handle = n.nvmlDeviceGetHandleByIndex(index)
            pci = n.nvmlDeviceGetPciInfo(handle)
        except n.NVMLError as exc:
            log.warning("NVML GPU %d skipped: %s", index, exc)
            return None
        bus_id = _text(pci.busId)
        entry: dict[str, Any] = {
            "index": index,
            "address": ids.pci_address(bus_id),
            "nvml_bus_id": bus_id,
            "pci_id": _pci_pair(pci.pciDeviceId),
            "pci_subsystem_id": _pci_pair(pci.pciSubSystemId),
        }
        try:
            entry["name"] = self._try(absent, "name", n.nvmlDeviceGetName, handle)
            entry["uuid"] = self._try(absent, "uuid", n.nvmlDeviceGetUUID, handle)
            entry["serial"] = self._try(absent, "serial", n.nvmlDeviceGetSerial, handle)
            memory = self._try(absent, "memory", n.nvmlDeviceGetMemoryInfo, handle)
            entry["memory"] = None if memory is None else {
                "total_mb": memory.total // _MIB, "used_mb": memory.used // _MIB,
                "free_mb": memory.free // _MIB}
            mode = self._try(absent, "virtualization_mode", n.nvmlDeviceGetVirtualizationMode, handle)
            entry["virtualization_mode"] = _named(VIRTUALIZATION_MODES, mode)
            entry["host_vgpu_mode"] = _named(
                HOST_VGPU_MODES, self._try(absent, "host_vgpu_mode", n.nvmlDeviceGetHostVgpuMode, handle))
            entry["mig"] = self._read_mig(handle, absent)
            entry["vgpu"] = self._read_vgpu(handle, absent)
        except _GpuLost as lost:
            entry.update(lost=True, error=f"the GPU was lost while it was read ({lost}); check `dmesg`")
        entry["not_supported"] = absent
        return entry

    def _read_mig(self, handle: Any, absent: list[str]) -> dict[str, Any]:
        modes = self._try(absent, "mig_mode", self.nvml.nvmlDeviceGetMigMode, handle)
        out: dict[str, Any] = {
            "supported": modes is not None,
            "current": None if modes is None else ("enabled" if modes[0] else "disabled"),
            "pending": None if modes is None else ("enabled" if modes[1] else "disabled"),
        }
        if modes is None:
            return out
        profiles = self._profiles(handle)
        out["profiles"] = [self._profile_json(p, handle, bool(modes[0])) for p in profiles]
        out["gpu_instances"] = self._gpu_instances_json(handle, profiles) if modes[0] else []
        return out

    def _profiles(self, handle: Any) -> list[tuple[int, Any]]:
        """(enum index, profile info) for every profile this GPU answers for."""
        n = self.nvml
        found = []
        for enum in range(getattr(n, "NVML_GPU_INSTANCE_PROFILE_COUNT", 18)):
            try:
                info = n.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum)
            except n.NVMLError as exc:
                self._raise_if_lost(exc)
                continue
            if info.instanceCount:
                found.append((enum, info))
        return found

    def _placements(self, handle: Any, info: Any) -> list[dict[str, int]]:
        n = self.nvml
        # instanceCount is no bound here (1g.10gb+me: 1 instance, 7 placements): ask for the count first
        count = ctypes.c_uint(0)
        try:
            n.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, None, ctypes.byref(count))
            array = (n.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
            count.value = len(array)
            n.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, array, ctypes.byref(count))
        except n.NVMLError as exc:
            self._raise_if_lost(exc)
            return []
        return [{"start": array[i].start, "size": array[i].size} for i in range(min(count.value, len(array)))]

    def _profile_json(self, item: tuple[int, Any], handle: Any, mig_on: bool) -> dict[str, Any]:
        enum, info = item
        out = {
            "id": info.id, "enum_index": enum, "name": _profile_name(enum, info),
            "display_name": _text(getattr(info, "name", b"")) or None,
            "compute_slices": info.sliceCount, "max_instances": info.instanceCount,
            "memory_mb": info.memorySizeMB, "multiprocessors": info.multiprocessorCount,
            "copy_engines": info.copyEngineCount, "decoders": info.decoderCount,
            "encoders": info.encoderCount, "jpegs": info.jpegCount, "ofas": info.ofaCount,
            "placements": self._placements(handle, info), "remaining": None,
        }
        if mig_on:
            try:
                out["remaining"] = self.nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, info.id)
            except self.nvml.NVMLError as exc:
                self._raise_if_lost(exc)
        return out

    def _gpu_instance_handles(self, handle: Any, profiles: list[tuple[int, Any]]) -> Iterator[Any]:
        n = self.nvml
        for _enum, info in profiles:
            array = (n.c_nvmlGpuInstance_t * info.instanceCount)()
            count = ctypes.c_uint(len(array))
            try:
                n.nvmlDeviceGetGpuInstances(handle, info.id, array, ctypes.byref(count))
            except n.NVMLError as exc:
                self._raise_if_lost(exc)
                continue
            yield from (array[i] for i in range(count.value))

    def _gpu_instances_json(self, handle: Any, profiles: list[tuple[int, Any]]) -> list[dict[str, Any]]:
        names = {info.id: mig_name for mig_name, info in ((_profile_name(e, i), i) for e, i in profiles)}
        out = []
        for gi in self._gpu_instance_handles(handle, profiles):
            info = self.nvml.nvmlGpuInstanceGetInfo(gi)
            out.append({"id": info.id, "profile_id": info.profileId, "profile": names.get(info.profileId),
                        "start": info.placement.start, "size": info.placement.size,
                        "compute_instances": self._compute_instances_json(gi)})
        return sorted(out, key=lambda g: (g["start"], g["id"]))

    def _compute_instance_handles(self, gi: Any) -> Iterator[Any]:
        n = self.nvml
        shared = getattr(n, "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", 0)
        for enum in range(getattr(n, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 9)):
            try:
                prof = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, enum, shared)
                array = (n.c_nvmlComputeInstance_t * max(prof.instanceCount, 1))()
                count = ctypes.c_uint(len(array))
                n.nvmlGpuInstanceGetComputeInstances(gi, prof.id, array, ctypes.byref(count))
            except n.NVMLError as exc:
                self._raise_if_lost(exc)
                continue
            yield from (array[i] for i in range(count.value))

    def _compute_instances_json(self, gi: Any) -> list[dict[str, Any]]:
        out = []
        for ci in self._compute_instance_handles(gi):
            info = self.nvml.nvmlComputeInstanceGetInfo(ci)
            out.append({"id": info.id, "profile_id": info.profileId,
                        "start": info.placement.start, "size": info.placement.size})
        return out

    def _read_vgpu(self, handle: Any, absent: list[str]) -> dict[str, Any]:
        n = self.nvml
        supported = self._try(absent, "supported_vgpu_types", n.nvmlDeviceGetSupportedVgpus, handle)
        creatable = self._try(absent, "creatable_vgpu_types", n.nvmlDeviceGetCreatableVgpus, handle)
        hetero = self._try(absent, "heterogeneous_mode", n.nvmlDeviceGetVgpuHeterogeneousMode, handle)
        return {
            "supported_types": [self._vgpu_type(handle, t) for t in supported or []],
            "creatable_type_ids": list(creatable) if creatable is not None else None,
            "heterogeneous_mode": None if hetero is None else bool(hetero),
            "mixed_size": nvml_mixed.read(n, handle, [int(t) for t in supported or []]),
            "scheduler": self._scheduler(handle, absent),
        }

    def _vgpu_type(self, handle: Any, type_id: int) -> dict[str, Any]:
        n = self.nvml
        skipped: list[str] = []
        name = self._try(skipped, "name", n.nvmlVgpuTypeGetName, type_id)
        fb = self._try(skipped, "framebuffer", n.nvmlVgpuTypeGetFramebufferSize, type_id)
        gi_profile = self._try(skipped, "gpu_instance_profile_id",
                               n.nvmlVgpuTypeGetGpuInstanceProfileId, type_id)
        parsed = ids.parse_type_name(name or "")
        return {
            "id": type_id, "type": f"nvidia-{type_id}", "name": name,
            "class": self._try(skipped, "class", n.nvmlVgpuTypeGetClass, type_id),
            "framebuffer_mb": None if fb is None else fb // _MIB,
            "max_instances": self._try(skipped, "max_instances", n.nvmlVgpuTypeGetMaxInstances,
                                       handle, type_id),
            "license": self._try(skipped, "license", n.nvmlVgpuTypeGetLicense, type_id),
            "series": parsed.series if parsed else None,
            "gpu_instance_profile_id": None if gi_profile in (None, INVALID_PROFILE_ID) else gi_profile,
            "mig_profile": mig.profile_for_type(name or ""),
            "not_supported": skipped,
        }

    def _scheduler(self, handle: Any, absent: list[str]) -> dict[str, Any] | None:
        n = self.nvml
        state = self._try(absent, "scheduler", n.nvmlDeviceGetVgpuSchedulerState, handle)
        if state is None:
            return None
        caps = self._try(absent, "scheduler_capabilities", n.nvmlDeviceGetVgpuSchedulerCapabilities, handle)
        arr = state.arrMode == getattr(n, "NVML_VGPU_SCHEDULER_ARR_ENABLE", 2)
        params = state.schedulerParams
        return {
            "policy": SCHEDULER_POLICIES.get(state.schedulerPolicy, str(state.schedulerPolicy)),
            "arr": arr,
            "timeslice_ns": params.vgpuSchedDataWithARR.timeslice if arr else params.vgpuSchedData.timeslice,
            "avg_factor": params.vgpuSchedDataWithARR.avgFactor if arr else None,
            "supported_policies": None if caps is None else
            [SCHEDULER_POLICIES.get(p, str(p)) for p in caps.supportedSchedulers if p],
            "min_timeslice_ns": None if caps is None else caps.minTimeslice,
            "max_timeslice_ns": None if caps is None else caps.maxTimeslice,
        }

    # -- helpers for reads -----------------------------------------------------------------------
    def _try(self, absent: list[str], field: str, fn: Callable[..., Any], *args: Any) -> Any:
        """The call's value, or None (and `field` noted) when this driver/GPU does not answer it."""
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            self._raise_if_lost(exc)
            absent.append(field if getattr(exc, "value", None) in _ABSENT else f"{field} ({exc})")
            return None

    @staticmethod
    def _raise_if_lost(exc: Exception) -> None:
        if getattr(exc, "value", None) == _GPU_IS_LOST:
            raise _GpuLost(str(exc)) from exc

    def addresses(self) -> dict[str, int]:
        """Every GPU NVML sees: its PCI address -> NVML's index (read once; again when one is asked for that
        is not among them). A GPU whose PCI facts NVML cannot give is left out."""
        if not self._addresses:
            self._read_addresses()
        return dict(self._addresses)

    def _read_addresses(self) -> None:
        self._require()
        self._addresses = {}
        for index in range(self.nvml.nvmlDeviceGetCount()):
            try:
                pci = self.nvml.nvmlDeviceGetPciInfo(self.nvml.nvmlDeviceGetHandleByIndex(index))
            except self.nvml.NVMLError:
                continue
            self._addresses[ids.pci_address(_text(pci.busId))] = index

    def _index(self, address: str) -> int:
        if address not in self._addresses:
            self._read_addresses()
        if address not in self._addresses:
            raise NotFound(f"NVML does not see a GPU at {address}",
                           hint="`vgpumgr gpus` lists the GPUs; is the NVIDIA driver bound to it?")
        return self._addresses[address]

    def _handle(self, address: str) -> Any:
        address = ids.pci_address(address)
        return self.nvml.nvmlDeviceGetHandleByIndex(self._index(address))

    def _require(self) -> None:
        if not self.open():
            raise Unavailable(self.notice or "NVML is unavailable",
                              hint="install the NVIDIA driver and nvidia-ml-py, or run on a vGPU host")

    # -- MIG writes --------------------------------------------------------------------------------
    def mig_table(self, address: str) -> mig.ProfileTable:
        self._require()
        with self._errors(f"reading MIG profiles of {address}"):
            handle = self._handle(address)
            profiles = [self._profile_json(p, handle, False) for p in self._profiles(handle)]
        if not profiles:
            raise Conflict(f"GPU {address} has no MIG profiles",
                           hint="MIG needs an A30, A100, H100, H200 or newer")
        return mig.ProfileTable.from_json(profiles)

    def gpu_instances(self, address: str) -> list[mig.Placed]:
        self._require()
        with self._errors(f"listing GPU instances of {address}"):
            handle = self._handle(address)
            gis = self._gpu_instances_json(handle, self._profiles(handle))
        return [mig.Placed(g["profile_id"], g["start"], g["size"], g["id"]) for g in gis]

    def set_mig_mode(self, address: str, enabled: bool) -> dict[str, Any]:
        """Ask for MIG on/off; report current and pending mode (a reset may still be needed on Ampere)."""
        self._require()
        n = self.nvml
        with self._errors(f"setting MIG mode of {address}"):
            handle = self._handle(address)
            n.nvmlDeviceSetMigMode(handle, n.NVML_DEVICE_MIG_ENABLE if enabled else n.NVML_DEVICE_MIG_DISABLE)
            current, pending = n.nvmlDeviceGetMigMode(handle)
        state = {"address": ids.pci_address(address), "current": "enabled" if current else "disabled",
                 "pending": "enabled" if pending else "disabled"}
        state["reset_required"] = current != pending
        if state["reset_required"]:
            state["hint"] = ("the change is pending: stop every process on the GPU "
                             "and reset it (nvidia-smi -r)")
        return state

    def set_vgpu_mode(self, address: str, mixed: bool) -> str:
        """Mixed-size (heterogeneous) or equal-size vGPU mode; returns the mode NVML reads back."""
        self._require()
        with self._errors(f"setting the vGPU mode of {address}"):
            handle = self._handle(address)
            nvml_mixed.set_mode(self.nvml, handle, mixed)
        facts = nvml_mixed.read(self.nvml, handle, [])
        return facts["mode"] or "unknown"

    def create_gpu_instance(self, address: str, profile: str | int, start: int | None = None,
                            compute_instance: bool = False) -> dict[str, Any]:
        """Create a GI at an explicit placement (chosen by the planner when `start` is None)."""
        self._require()
        n = self.nvml
        table = self.mig_table(address)
        wanted = table.find(profile)
        with self._errors(f"reading the MIG mode of {address}"):
            current, pending = n.nvmlDeviceGetMigMode(self._handle(address))
        if not current:
            raise Conflict(f"MIG mode is off on {address}" + (" (on after a GPU reset)" if pending else ""),
                           hint="enable it first (`vgpumgr mig enable`), then reset the GPU if that is pending")
        placed = mig.plan(table, self.gpu_instances(address), wanted, start)
        with self._errors(f"creating GPU instance {wanted.name} at {placed.start} on {address}"):
            handle = self._handle(address)
            placement = n.c_nvmlGpuInstancePlacement_t()
            placement.start, placement.size = placed.start, placed.size
            gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(handle, wanted.id, ctypes.byref(placement))
            info = n.nvmlGpuInstanceGetInfo(gi)
        out: dict[str, Any] = {
            "address": ids.pci_address(address), "id": info.id, "profile_id": wanted.id,
            "profile": wanted.name, "start": info.placement.start, "size": info.placement.size,
            "compute_instances": []}
        if compute_instance:
            try:
                out["compute_instances"].append(self._create_compute_instance(gi, wanted))
            except VgpuError:
                with self._errors(f"rolling back GPU instance {info.id}"):
                    n.nvmlGpuInstanceDestroy(gi)
                raise
        return out

    def _create_compute_instance(self, gi: Any, profile: mig.Profile) -> dict[str, Any]:
        n = self.nvml
        enum = _CI_ENUM_BY_SLICES.get(profile.compute_slices)
        if enum is None:
            raise InvalidInput(f"no compute-instance profile spans {profile.compute_slices} slices")
        with self._errors(f"creating a compute instance in {profile.name}"):
            ci_profile = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, enum, getattr(n, "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", 0))
            ci = n.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)
            info = n.nvmlComputeInstanceGetInfo(ci)
        return {"id": info.id, "profile_id": info.profileId, "start": info.placement.start,
                "size": info.placement.size}

    def destroy_gpu_instance(self, address: str, gi_id: int) -> dict[str, Any]:
        """Destroy a GI and the compute instances in it."""
        self._require()
        n = self.nvml
        with self._errors(f"destroying GPU instance {gi_id} on {address}"):
            handle = self._handle(address)
            gi = n.nvmlDeviceGetGpuInstanceById(handle, int(gi_id))
            info = n.nvmlGpuInstanceGetInfo(gi)
            removed_ci = []
            for ci in list(self._compute_instance_handles(gi)):
                removed_ci.append(n.nvmlComputeInstanceGetInfo(ci).id)
                n.nvmlComputeInstanceDestroy(ci)
            n.nvmlGpuInstanceDestroy(gi)
        return {"address": ids.pci_address(address), "id": info.id, "profile_id": info.profileId,
                "start": info.placement.start, "size": info.placement.size, "compute_instances": removed_ci}

    # -- vGPU scheduler -----------------------------------------------------------------------------
    def scheduler(self, address: str) -> dict[str, Any] | None:
        self._require()
        with self._errors(f"reading the vGPU scheduler of {address}"):
            return self._scheduler(self._handle(address), [])

    def set_scheduler(self, address: str, policy: str, timeslice_ns: int | None = None) -> dict[str, Any]:
        """best-effort | equal-share | fixed-share, optionally with a time slice (ns); no VM may run."""
        self._require()
        n = self.nvml
        codes = {v: k for k, v in SCHEDULER_POLICIES.items() if k}
        if policy not in codes:
            raise InvalidInput(f"'{policy}' is not a vGPU scheduler policy", hint="use " + ", ".join(codes))
        if timeslice_ns is not None and (policy == "best-effort" or timeslice_ns <= 0):
            raise InvalidInput("a time slice applies to equal-share and fixed-share only and must be > 0",
                               hint="e.g. --policy equal-share --timeslice-ns 2000000 (2 ms)")
        current = self.scheduler(address)
        if current is None:
            raise Conflict(f"GPU {address} has no vGPU scheduler",
                           hint="the scheduler exists on a vGPU host driver only")
        low, high = current.get("min_timeslice_ns"), current.get("max_timeslice_ns")
        if timeslice_ns is not None and low and high and not low <= timeslice_ns <= high:
            raise InvalidInput(f"time slice {timeslice_ns} ns is outside {low}..{high} ns for this GPU")
        state = n.c_nvmlVgpuSchedulerSetState_t()
        state.schedulerPolicy = codes[policy]
        state.enableARRMode = getattr(n, "NVML_VGPU_SCHEDULER_ARR_DISABLE", 1) if timeslice_ns else \
            getattr(n, "NVML_VGPU_SCHEDULER_ARR_DEFAULT", 0)
        state.schedulerParams.vgpuSchedData.timeslice = timeslice_ns or 0
        with self._errors(f"setting the vGPU scheduler of {address}"):
            n.nvmlDeviceSetVgpuSchedulerState(self._handle(address), state)
        return {"address": ids.pci_address(address), "before": current, "after": self.scheduler(address)}

    @contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except self.nvml.NVMLError as exc:
            raise nvml_error(exc, action) from exc


_CI_ENUM_BY_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}
_ENUM_SLICES = {0: "1g", 1: "2g", 2: "3g", 3: "4g", 4: "7g", 5: "8g", 6: "6g", 7: "1g", 8: "2g", 9: "1g"}


def nvml_error(exc: Exception, action: str) -> VgpuError:
    """An NVML failure as a vgpumgr error with advice."""
    code = getattr(exc, "value", None)
    table: dict[int, tuple[type[VgpuError], str]] = {
        _NOT_SUPPORTED: (Conflict, "this GPU or driver does not support it (MIG and vGPU settings need a "
                                   "vGPU host driver or a MIG-capable GPU)"),
        _FUNCTION_NOT_FOUND: (Conflict, "the installed NVIDIA driver is too old for this call"),
        _NO_PERMISSION: (PermissionDenied, "run as root"),
        _IN_USE: (Busy, "the GPU or instance is in use; stop the VMs or processes using it first"),
        _INSUFFICIENT_RESOURCES: (NoCapacity, "no room left; destroy an instance or pick a smaller profile"),
        _INVALID_ARGUMENT: (InvalidInput, "the driver rejected the value (placement, profile or mode)"),
        _NOT_FOUND: (NotFound, "it does not exist (destroyed already?); `vgpumgr mig list` shows them"),
        _GPU_IS_LOST: (Unavailable, "the GPU fell off the bus; check `dmesg`"),
        _RESET_REQUIRED: (Conflict, "the GPU needs a reset (nvidia-smi -r) with no process using it"),
    }
    cls, hint = table.get(code, (KernelError, "check `dmesg` and `nvidia-smi` for the driver's message"))
    return cls(f"{action} failed: {exc}", hint=hint, nvml_error=code)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value or "")


def _pci_pair(combined: int) -> str:
    """NVML packs device<<16 | vendor: 0x233010DE -> '10de:2330'."""
    return f"{combined & 0xFFFF:04x}:{(combined >> 16) & 0xFFFF:04x}"


def _named(names: dict[int, str], value: int | None) -> str | None:
    return None if value is None else names.get(value, str(value))


def _profile_name(enum: int, info: Any) -> str:
    raw = _text(getattr(info, "name", b""))
    try:
        return mig.normalise_profile_name(raw) if raw else _name_from_enum(enum, info)
    except InvalidInput:
        return raw


def _name_from_enum(enum: int, info: Any) -> str:
    """Profile info v1 has no name: rebuild it from slices and memory (GB rounded as NVIDIA does)."""
    gb = round(info.memorySizeMB / 1024) or 1
    suffix = "+me" if enum == 7 or enum == 8 else ""
    return f"{_ENUM_SLICES.get(enum, f'{info.sliceCount}g')}.{gb}gb{suffix}"
