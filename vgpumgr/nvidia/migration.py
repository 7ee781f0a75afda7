"""NVML's vGPU migration check, from both ends (docs/sources.md §18).

Source: `source_facts` finds the running vGPU instance of a VM's vGPU (`nvmlDeviceGetActiveVgpus`, by mdev
UUID or VM UUID) and takes its metadata (`nvmlVgpuInstanceGetMetadata`: the whole structure travels,
base64, in the domain's vgpumgr metadata) and the facts the documented rules compare. Destination:
`verdict` asks NVML (`nvmlDeviceGetVgpuMetadata` + `nvmlGetVgpuCompatibility`) for a candidate GPU and reads
its answer; where NVML cannot answer (no metadata travelled, no vGPU manager: the call is NotSupported, as on
a GPU in passthrough mode) the rules of vgpumgr.nvidia.compat decide, and the answer says so.
"""

from __future__ import annotations

import base64
import ctypes
import dataclasses
from typing import Any

from vgpumgr import ids
from vgpumgr.errors import VgpuError
from vgpumgr.nvidia import compat
from vgpumgr.nvidia.nvml import NvmlLayer


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value or "")


def _errors(layer: NvmlLayer) -> tuple[type[BaseException], ...]:
    return (layer.nvml.NVMLError,) if layer.nvml is not None else ()


def source_facts(layer: NvmlLayer | None, gpu: str, *, mdev_uuid: str | None = None,
                 vm_uuid: str | None = None, type_id: int | None = None) -> dict[str, Any]:
    """What the source knows of one running vGPU: host driver, guest driver and vGPU version, NVML's
    metadata (base64), and `nvml`: "ok", or why NVML could not say (the rules then decide at the destination)."""
    out: dict[str, Any] = {"nvml": "absent"}
    if layer is None or not layer.open():
        out["nvml"] = (layer.notice if layer is not None else None) or "NVML is not available on the source"
        return out
    n = layer.nvml
    out["host_driver"] = layer.driver().get("driver_version")
    try:
        handle = layer._handle(gpu)
        instances = n.nvmlDeviceGetActiveVgpus(handle)
        inst = next((i for i in instances if _matches(n, i, mdev_uuid, vm_uuid, type_id)), None)
        if inst is None:
            out["nvml"] = f"NVML lists no running vGPU for this device on {gpu} (is the VM running?)"
            return out
        meta = n.nvmlVgpuInstanceGetMetadata(inst)
    except _errors(layer) as exc:
        out["nvml"] = f"NVML cannot describe the vGPU on {gpu}: {exc}"
        return out
    except VgpuError as exc:  # the layer's NotFound: NVML does not see this GPU
        out["nvml"] = f"NVML cannot describe the vGPU on {gpu}: {exc.message}"
        return out
    raw = ctypes.string_at(ctypes.addressof(meta), ctypes.sizeof(meta))
    out.update(nvml="ok", host_driver=_text(meta.hostDriverVersion) or out["host_driver"],
               guest_driver=_text(meta.guestDriverVersion) or None,
               guest_vgpu_version=int(meta.guestVgpuVersion) or None, nvml_metadata=base64.b64encode(raw).decode())
    return out


def _matches(n: Any, inst: int, mdev_uuid: str | None, vm_uuid: str | None, type_id: int | None) -> bool:
    if mdev_uuid:
        return _text(n.nvmlVgpuInstanceGetMdevUUID(inst)).lower() == mdev_uuid
    if vm_uuid and _text(n.nvmlVgpuInstanceGetVmID(inst)[0]).lower() == vm_uuid:
        return type_id is None or n.nvmlVgpuInstanceGetType(inst) == type_id
    return False


def _metadata(n: Any, blob: str) -> Any | None:
    try:
        raw = base64.b64decode(blob, validate=True)
    except ValueError:
        return None
    cls = n.c_nvmlVgpuMetadata_t
    return cls.from_buffer_copy(raw) if len(raw) == ctypes.sizeof(cls) else None


def verdict(layer: NvmlLayer | None, candidate: compat.CandidateGpu, vgpu: compat.MigratingVgpu,
            offered_type: str | None, nvml_metadata: str | None) -> compat.Verdict:
    """May `vgpu` run on, live, on `candidate`? NVML's answer where it can give one, else the rules'."""
    rules = compat.live_migration(vgpu, candidate, offered_type)
    if not rules.live and rules.limit == compat.LIMIT_TYPE:
        return rules  # NVML compares metadata, not the type this GPU offers
    if not nvml_metadata or layer is None or not layer.open():
        return rules
    n = layer.nvml
    meta = _metadata(n, nvml_metadata)
    if meta is None:
        return dataclasses.replace(rules, note="the source's NVML metadata could not be read here")
    try:
        pgpu = n.nvmlDeviceGetVgpuMetadata(layer._handle(candidate.address))
        answer = n.nvmlGetVgpuCompatibility(meta, pgpu)
    except _errors(layer) as exc:  # NotSupported: no vGPU manager on this GPU
        return dataclasses.replace(rules, note=f"NVML cannot compare here ({exc})")
    except VgpuError as exc:  # the layer's NotFound: NVML does not see this GPU
        return dataclasses.replace(rules, note=exc.message)
    said = compat.from_nvml(int(answer.vgpuVmCompatibility), int(answer.compatibilityLimitCode))
    if not said.live and said.limit == rules.limit == compat.LIMIT_GUEST_DRIVER:  # NVML names no versions
        return dataclasses.replace(said, reason=f"{said.reason}: {rules.reason}")
    return said


def candidate(layer: NvmlLayer | None, address: str, device_id: str | None, name: str | None) -> compat.CandidateGpu:
    """A destination GPU as the rules see it: its board from sysfs, its vGPU manager and range from NVML."""
    driver, rng = None, None
    if layer is not None and layer.open():
        driver = layer.driver().get("driver_version")
        try:
            (low, high), _current = layer.nvml.nvmlGetVgpuVersion()
            rng = (int(low), int(high))
        except _errors(layer):
            rng = None
    return compat.CandidateGpu(ids.pci_address(address), device_id, name, driver, rng)
