"""NVIDIA's rules for moving a running vGPU to another physical GPU, as a pure function.

NVML answers the question itself where the vGPU manager supports it (`nvmlGetVgpuCompatibility` on the
source vGPU's metadata and the candidate GPU's metadata); this module is the documented fallback where NVML
says NotSupported or has no running vGPU to ask about, and the rules the simulated NVML applies. Sources
(docs/sources.md): NVIDIA's vGPU user guide ("Migrating a VM Configured with vGPU": same vGPU type, the
same GPU board; not between board variants such as H100 PCIe and H100 NVL, nor across H100/H200/H800),
Red Hat's RHEL 9 guide ("Migrating a virtual machine with a vGPU": the vGPU manager versions must match),
and NVML's vGPU Migration API (the limit codes below mirror `nvmlVgpuPgpuCompatibilityLimitCode_t`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vgpumgr.ids import parse_type_name
from vgpumgr.nvidia import driver_window

# why a migration is not possible, as NVML's limit codes name it (plus the type, which NVML never sees:
# a vGPU is only ever compared with GPUs that offer its type)
LIMIT_NONE = "none"
LIMIT_HOST_DRIVER = "host-driver"
LIMIT_GUEST_DRIVER = "guest-driver"
LIMIT_GPU = "gpu"
LIMIT_OTHER = "other"
LIMIT_TYPE = "type"

# nvmlVgpuPgpuCompatibilityLimitCode_t bits -> our names (the first set bit in this order wins)
NVML_LIMITS = ((0x1, LIMIT_HOST_DRIVER), (0x2, LIMIT_GUEST_DRIVER), (0x4, LIMIT_GPU), (0x80000000, LIMIT_OTHER))
NVML_COMPATIBILITY_LIVE = 0x8


@dataclass(frozen=True)
class MigratingVgpu:
    """What the source knows of one running vGPU (it travels in the domain's vgpumgr metadata)."""

    type_name: str  # NVIDIA's name, "NVIDIA L40S-4Q" or the short "L40S-4Q"
    device_id: str | None = None  # PCI device id of the source's physical GPU ("26b9"): the board
    gpu_name: str | None = None  # for messages
    host_driver: str | None = None  # the source's vGPU manager version ("580.95.02")
    guest_driver: str | None = None  # the guest's driver, once it reported one
    guest_vgpu_version: int | None = None  # the vGPU version the guest negotiated


@dataclass(frozen=True)
class CandidateGpu:
    """A physical GPU on the destination."""

    address: str
    device_id: str | None
    gpu_name: str | None
    host_driver: str | None
    vgpu_range: tuple[int, int] | None = None  # vGPU versions this vGPU manager supports (nvmlGetVgpuVersion)


@dataclass(frozen=True)
class Verdict:
    live: bool
    limit: str  # LIMIT_*
    reason: str  # empty when live
    source: str = "rules"  # "nvml" when NVML decided, "rules" when these rules did
    note: str = ""  # why the rules decided where NVML was asked

    def as_dict(self) -> dict[str, object]:
        return {"live": self.live, "limit": self.limit, "reason": self.reason, "source": self.source,
                **({"note": self.note} if self.note else {})}


def same_type(a: str, b: str) -> bool:
    """The same vGPU type: equal short names ("GRID T4-4Q" and "T4-4Q" are one type)."""
    pa, pb = parse_type_name(a), parse_type_name(b)
    if pa is None or pb is None:
        return a.strip() == b.strip()
    return pa.short == pb.short


def _board(device_id: str | None, name: str | None) -> str:
    return f"{name} (10de:{device_id})" if name and device_id else (name or f"10de:{device_id}")


def live_migration(vgpu: MigratingVgpu, gpu: CandidateGpu, offered_type: str | None = None) -> Verdict:
    """May `vgpu` continue, live, on `gpu`? `offered_type` is the destination's name for the type when
    it offers one of the same short name (None: it does not offer it)."""
    if offered_type is None or not same_type(vgpu.type_name, offered_type):
        return Verdict(False, LIMIT_TYPE, f"{gpu.address} does not offer vGPU type {vgpu.type_name}: a vGPU keeps "
                                          "its type when it migrates")
    if vgpu.device_id and gpu.device_id and vgpu.device_id.lower() != gpu.device_id.lower():
        return Verdict(False, LIMIT_GPU, f"{gpu.address} is another board ({_board(gpu.device_id, gpu.gpu_name)}) "
                                         f"than the source's ({_board(vgpu.device_id, vgpu.gpu_name)}); NVIDIA "
                                         "migrates a vGPU only between GPUs of the same board")
    if vgpu.host_driver and gpu.host_driver and vgpu.host_driver != gpu.host_driver:
        return Verdict(False, LIMIT_HOST_DRIVER,
                       f"the vGPU manager differs: {gpu.host_driver} on {gpu.address}, {vgpu.host_driver} at the "
                       "source; a live migration needs the same vGPU manager version on both hosts")
    if vgpu.guest_driver and gpu.host_driver:
        accepted = driver_window.accepts(gpu.host_driver, vgpu.guest_driver)
        if accepted.ok is False:
            return Verdict(False, LIMIT_GUEST_DRIVER, f"{gpu.address}: {accepted.reason}")
    if vgpu.guest_vgpu_version is not None and gpu.vgpu_range is not None:
        low, high = gpu.vgpu_range
        if not low <= vgpu.guest_vgpu_version <= high:
            return Verdict(False, LIMIT_GUEST_DRIVER,
                           f"the guest's driver ({vgpu.guest_driver or 'unknown version'}) negotiated vGPU version "
                           f"{vgpu.guest_vgpu_version:#x}, outside {low:#x}-{high:#x} that the vGPU manager on "
                           f"{gpu.address} supports")
    return Verdict(True, LIMIT_NONE, "")


def from_nvml(vm_compatibility: int, limit_code: int) -> Verdict:
    """NVML's own answer (`nvmlGetVgpuCompatibility`) as a Verdict."""
    if vm_compatibility & NVML_COMPATIBILITY_LIVE:
        return Verdict(True, LIMIT_NONE, "", source="nvml")
    limit = next((name for bit, name in NVML_LIMITS if limit_code & bit), LIMIT_OTHER)
    words = {LIMIT_HOST_DRIVER: "the host driver (vGPU manager) version",
             LIMIT_GUEST_DRIVER: "the guest driver version", LIMIT_GPU: "the GPU hardware",
             LIMIT_OTHER: "a reason NVML does not name"}
    return Verdict(False, limit, f"NVML allows no live migration here: limited by {words[limit]}", source="nvml")
