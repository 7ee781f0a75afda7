"""Mixed-size mode and placement IDs in the simulated NVML (docs/sources.md §21).

The driver's side (which vGPUs exist, their placements, the mode) lives in the simulator's sysfs state
(vgpumgr.sim.placements); these calls read it, as NVML asks the same driver on a host:
- `nvmlDeviceGetVgpuCapabilities`: HETEROGENEOUS_TIMESLICE_SIZES only with VFs enabled, MIG off, on a
  generation that has it; HOMOGENEOUS_PLACEMENTS on Ada and newer from R570.
- `nvmlDevice{Get,Set}VgpuHeterogeneousMode`: NOT_SUPPORTED with MIG on or without the capability; the set
  answers IN_USE while any vGPU (an mdev, a VF with a type) exists on the GPU.
- `nvmlDeviceGetVgpuType{Supported,Creatable}Placements`, `nvmlVgpuInstanceGetPlacementId`.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pynvml

from vgpumgr.hostfs.root import SIM_MARKER
from vgpumgr.sim import placements as simplace

CAP_HETEROGENEOUS_SIZES, CAP_HOMOGENEOUS_PLACEMENTS = 2, 9
HETEROGENEOUS_MODE, HOMOGENEOUS_MODE = 0, 1  # placement-list mode: the opposite polarity of the mode struct


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class VgpuPlacements:
    """Mixed into SimNvml (which supplies `state_path`, `_read`, `_mutate`, `_instance`, `_type`)."""

    state_path: Path
    _read: Any
    _mutate: Any
    _instance: Any
    _type: Any

    # -- the driver's view -------------------------------------------------------------------------
    def _driver_gpu(self, address: str) -> dict[str, Any] | None:
        try:
            state = json.loads((self.state_path.parent / SIM_MARKER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return state.get("gpus", {}).get(address)

    def _numvfs(self, address: str) -> int:
        try:
            return int((self.state_path.parent / f"sys/bus/pci/devices/{address}/sriov_numvfs").read_text())
        except (OSError, ValueError):
            return 0

    def _mixed_gpu(self, handle: Any, call: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        gpu, spec = self._read(handle, call)
        if spec.mig_table and gpu["mig_mode"][0]:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu, self._driver_gpu(gpu["address"])

    # -- capability and mode -----------------------------------------------------------------------
    def nvmlDeviceGetVgpuCapabilities(self, handle: Any, capability: int) -> int:  # noqa: N802 - pynvml's names
        gpu, _spec = self._read(handle, "nvmlDeviceGetVgpuCapabilities")
        drv = self._driver_gpu(gpu["address"])
        if drv is None:
            return 0
        if capability == CAP_HETEROGENEOUS_SIZES:
            return int(simplace.capable(drv, self._numvfs(gpu["address"])))
        if capability == CAP_HOMOGENEOUS_PLACEMENTS:
            return int(simplace.homogeneous_ids(drv))
        return 0

    def nvmlDeviceGetVgpuHeterogeneousMode(self, handle: Any) -> int:  # noqa: N802
        gpu, drv = self._mixed_gpu(handle, "nvmlDeviceGetVgpuHeterogeneousMode")
        if drv is None:
            return gpu["heterogeneous_mode"]
        return int(bool(drv.get("heterogeneous")))

    def nvmlDeviceSetVgpuHeterogeneousMode(self, handle: Any, mode: int) -> int:  # noqa: N802
        gpu, drv = self._mixed_gpu(handle, "nvmlDeviceSetVgpuHeterogeneousMode")
        if drv is None:  # an NVML without a simulated driver behind it
            with self._mutate() as state:
                self._read(handle, "nvmlDeviceSetVgpuHeterogeneousMode")
                state["gpus"][[g["address"] for g in state["gpus"]].index(gpu["address"])]["heterogeneous_mode"] = (
                    int(bool(mode)))
            return pynvml.NVML_SUCCESS
        with self._driver(gpu["address"]) as (tree, dgpu):
            if not simplace.capable(dgpu, self._numvfs(gpu["address"])):
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            from vgpumgr.sim import gpus as simgpus

            if simgpus.existing_vgpus(tree, gpu["address"]):
                raise _err(pynvml.NVML_ERROR_IN_USE)
            dgpu["heterogeneous"] = bool(mode)
            dgpu["placements"] = {}
            simgpus.refresh(tree, gpu["address"])
        with self._mutate() as state:
            for g in state["gpus"]:
                if g["address"] == gpu["address"]:
                    g["heterogeneous_mode"] = int(bool(mode))
        return pynvml.NVML_SUCCESS

    @contextmanager
    def _driver(self, address: str) -> Any:
        from vgpumgr.sim.tree import SimTree

        root = self.state_path.parent
        with open(root / ".vgpumgr-sim.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            tree = SimTree(root)
            yield tree, tree.state["gpus"][address]
            tree.save(force=True)

    # -- placements --------------------------------------------------------------------------------
    def _placement_list(self, handle: Any, type_id: int, ref: Any, call: str, creatable: bool) -> int:
        gpu, drv = self._mixed_gpu(handle, call)
        t = self._type(type_id)
        spec_types = {s.id for s in self.profiles[gpu["profile"]].types}  # type: ignore[attr-defined]
        if drv is None or type_id not in spec_types or t.gi_profile_id is not None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        lst = ref._obj if hasattr(ref, "_obj") else ref
        dt = next((c for c in drv["catalog"] if c["id"] == type_id),
                  {"id": type_id, "framebuffer_mb": t.framebuffer_mb, "max_instance": t.max_instances})
        mode = getattr(lst, "mode", HETEROGENEOUS_MODE) if lst.version >> 24 >= 2 else HETEROGENEOUS_MODE
        if creatable:
            mixed = bool(drv.get("heterogeneous"))
            if not mixed and not simplace.homogeneous_ids(drv):
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            size, _ids = simplace.slots(drv, dt, mixed)
            ids = simplace.creatable_ids(drv, dt, mixed)
        else:
            if mode == HOMOGENEOUS_MODE and not simplace.homogeneous_ids(drv):
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            size, ids = simplace.slots(drv, dt, mode == HETEROGENEOUS_MODE)
        if lst.count and len(ids) > lst.count:
            lst.count = len(ids)
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        buf = ctypes.cast(lst.placementIds, ctypes.POINTER(ctypes.c_uint))
        for i, p in enumerate(ids):
            buf[i] = p
        lst.count, lst.placementSize = len(ids), size
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetVgpuTypeSupportedPlacements(self, handle: Any, type_id: int, mode: int = 0,  # noqa: N802
                                                 version: int = 1) -> Any:
        return self._placements(handle, type_id, mode, version, "nvmlDeviceGetVgpuTypeSupportedPlacements", False)

    def nvmlDeviceGetVgpuTypeCreatablePlacements(self, handle: Any, type_id: int, version: int = 1) -> Any:  # noqa: N802
        return self._placements(handle, type_id, 0, version, "nvmlDeviceGetVgpuTypeCreatablePlacements", True)

    def _placements(self, handle: Any, type_id: int, mode: int, version: int, call: str, creatable: bool) -> Any:
        """As pynvml's wrappers: a list struct sized by nvmlVgpuTypeGetMaxInstances, filled by the call."""
        maxi = self.nvmlVgpuTypeGetMaxInstances(handle, type_id)  # type: ignore[attr-defined]
        if version == 2:
            lst = pynvml.c_nvmlVgpuPlacementList_v2_t()
            lst.version, lst.count, lst.mode = pynvml.VgpuPlacementList_v2, maxi, mode
        else:
            lst = pynvml.c_nvmlVgpuPlacementList_v1_t()
            lst.version = pynvml.VgpuPlacementList_v1
        lst.placementIds = (ctypes.c_uint * max(maxi, 1))()
        if version == 1:  # v1 leaves count at 0 on input: the caller's buffer is max_instance long
            lst.count = 0
        self._placement_list(handle, type_id, lst, call, creatable)
        return lst

    def nvmlVgpuInstanceGetPlacementId(self, vgpu_instance: int) -> int:  # noqa: N802
        gpu, inst = self._instance(vgpu_instance, "nvmlVgpuInstanceGetPlacementId")
        drv = self._driver_gpu(gpu["address"])
        if drv is None or not drv.get("heterogeneous"):
            return 0xFFFF  # NVML_INVALID_VGPU_PLACEMENT_ID outside mixed-size mode
        place = simplace.placement_of(drv, inst.get("mdev_uuid") or inst.get("vf") or "")
        return 0xFFFF if place is None else place
