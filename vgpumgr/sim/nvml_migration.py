"""NVML's vGPU migration calls in the simulated NVML (docs/sources.md §18).

The source asks a running vGPU for its metadata (`nvmlVgpuInstanceGetMetadata`), the destination asks each
candidate GPU for its own (`nvmlDeviceGetVgpuMetadata`) and NVML compares the two
(`nvmlGetVgpuCompatibility`). The real blobs are opaque; the simulator fills them with JSON of the facts
NVIDIA's documented rules compare (vgpumgr.nvidia.compat), so the answer follows those rules: the same type, the
same board, the same vGPU manager version, and the guest's vGPU version inside the destination's range.

State it reads: the NVML state file's `driver_version` (the host's vGPU manager; a test changes it to make
an incompatible host) and `vgpu_version_range` ([min, max], default below), a running vGPU's
`guest_vgpu_version` (default: the top of the host's range when the guest started).
"""

from __future__ import annotations

import json
from typing import Any

import pynvml

from vgpumgr.nvidia import compat

# what nvmlGetVgpuVersion answered on the real H100 with driver 580.159.04 (tests/fixtures/nvml/h100-vgpu.json)
DEFAULT_VGPU_RANGE = (0x120001, 0x1A0001)
_LIVE_AND_BELOW = (pynvml.NVML_VGPU_VM_COMPATIBILITY_COLD | pynvml.NVML_VGPU_VM_COMPATIBILITY_HIBERNATE
                   | pynvml.NVML_VGPU_VM_COMPATIBILITY_SLEEP | pynvml.NVML_VGPU_VM_COMPATIBILITY_LIVE)
_LIMIT_BITS = {compat.LIMIT_HOST_DRIVER: pynvml.NVML_VGPU_COMPATIBILITY_LIMIT_HOST_DRIVER,
               compat.LIMIT_GUEST_DRIVER: pynvml.NVML_VGPU_COMPATIBILITY_LIMIT_GUEST_DRIVER,
               compat.LIMIT_GPU: pynvml.NVML_VGPU_COMPATIBILITY_LIMIT_GPU,
               compat.LIMIT_TYPE: pynvml.NVML_VGPU_COMPATIBILITY_LIMIT_OTHER,
               compat.LIMIT_OTHER: pynvml.NVML_VGPU_COMPATIBILITY_LIMIT_OTHER}


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _deref(ref: Any) -> Any:
    obj = getattr(ref, "_obj", ref)
    if obj is None:
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return obj


def _opaque(struct: Any, facts: dict[str, Any]) -> None:
    data = json.dumps(facts, sort_keys=True).encode()
    room = type(struct).opaqueData.size
    if len(data) > room:  # never in the simulator's own facts; a guard for hand-made states
        raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    struct.opaqueData = data
    struct.opaqueDataSize = len(data)


def _s(value: Any) -> str:
    """pynvml's structures hand back their char arrays as str (they decode bytes on the way out)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value or "")


def _facts(struct: Any) -> dict[str, Any]:
    data = struct.opaqueData
    raw = (data.encode() if isinstance(data, str) else bytes(data))[: struct.opaqueDataSize]
    try:
        return json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None


class VgpuMigration:
    """pynvml's migration calls, mixed into SimNvml (which supplies `_load`, `_read`, `_instance`, `_type` and
    `profiles`, its GPU specs)."""

    profiles: Any
    _load: Any
    _read: Any
    _instance: Any
    _type: Any

    def _range(self) -> tuple[int, int]:
        low, high = self._load().get("vgpu_version_range") or DEFAULT_VGPU_RANGE
        return int(low), int(high)

    def nvmlGetVgpuVersion(self, supported: Any = None, current: Any = None) -> Any:  # noqa: N802
        low, high = self._range()
        if supported is None and current is None:
            return [(low, high), (low, high)]
        for ref in (supported, current):
            v = _deref(ref)
            v.minVersion, v.maxVersion = low, high
        return pynvml.NVML_SUCCESS

    def nvmlVgpuInstanceGetMetadata(self, vgpu_instance: int) -> Any:  # noqa: N802
        gpu, inst = self._instance(vgpu_instance, "nvmlVgpuInstanceGetMetadata")
        spec = self._spec_of(gpu)
        meta = pynvml.c_nvmlVgpuMetadata_t()
        meta.version, meta.revision = 1, 1
        meta.guestInfoState = (pynvml.NVML_VGPU_INSTANCE_GUEST_INFO_STATE_INITIALIZED if inst.get("guest_driver")
                               else pynvml.NVML_VGPU_INSTANCE_GUEST_INFO_STATE_UNINITIALIZED)
        meta.guestDriverVersion = (inst.get("guest_driver") or "").encode()
        meta.hostDriverVersion = self._load()["driver_version"].encode()
        meta.guestVgpuVersion = int(inst.get("guest_vgpu_version") or self._range()[1])
        _opaque(meta, {"type_id": inst["type_id"], "device_id": f"{spec.pci_id[1]:04x}", "gpu_name": spec.name})
        return meta

    def nvmlVgpuInstanceGetRuntimeStateSize(self, vgpu_instance: int) -> Any:  # noqa: N802
        inst = self._instance(vgpu_instance, "nvmlVgpuInstanceGetRuntimeStateSize")[1]
        state = pynvml.nvmlVgpuRuntimeState_v1_t()
        state.version = pynvml.VgpuRuntimeState_v1
        # [simulator's choice] the framebuffer plus 64 MiB of device state
        state.size = self._type(inst["type_id"]).framebuffer_mb * 1024 * 1024 + (64 << 20)
        return state

    def nvmlDeviceGetVgpuMetadata(self, handle: Any) -> Any:  # noqa: N802
        gpu, spec = self._read(handle, "nvmlDeviceGetVgpuMetadata")
        meta = pynvml.c_nvmlVgpuPgpuMetadata_t()
        meta.version, meta.revision = 1, 1
        meta.hostDriverVersion = self._load()["driver_version"].encode()
        low, high = self._range()
        meta.hostSupportedVgpuRange.minVersion, meta.hostSupportedVgpuRange.maxVersion = low, high
        _opaque(meta, {"device_id": f"{spec.pci_id[1]:04x}", "gpu_name": spec.name, "address": gpu["address"],
                       "types": [t.id for t in spec.types]})
        return meta

    def nvmlGetVgpuCompatibility(self, vgpu_metadata: Any, pgpu_metadata: Any) -> Any:  # noqa: N802
        vm, pm = _deref(vgpu_metadata), _deref(pgpu_metadata)
        vf, pf = _facts(vm), _facts(pm)
        self._load()
        name = self._type(int(vf["type_id"])).name
        vgpu = compat.MigratingVgpu(name, device_id=vf.get("device_id"), gpu_name=vf.get("gpu_name"),
                                    host_driver=_s(vm.hostDriverVersion) or None,
                                    guest_driver=_s(vm.guestDriverVersion) or None,
                                    guest_vgpu_version=vm.guestVgpuVersion or None)
        gpu = compat.CandidateGpu(pf.get("address", ""), pf.get("device_id"), pf.get("gpu_name"),
                                  _s(pm.hostDriverVersion) or None,
                                  (pm.hostSupportedVgpuRange.minVersion, pm.hostSupportedVgpuRange.maxVersion))
        offered = name if int(vf["type_id"]) in pf.get("types", ()) else None
        verdict = compat.live_migration(vgpu, gpu, offered)
        out = pynvml.c_nvmlVgpuPgpuCompatibility_t()
        out.vgpuVmCompatibility = _LIVE_AND_BELOW if verdict.live else pynvml.NVML_VGPU_VM_COMPATIBILITY_NONE
        out.compatibilityLimitCode = 0 if verdict.live else _LIMIT_BITS[verdict.limit]
        return out

    def _spec_of(self, gpu: dict[str, Any]) -> Any:
        return self.profiles[gpu["profile"]]
