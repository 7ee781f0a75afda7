"""Plain dataclasses for one snapshot of a host: what discovery returns and placement consumes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from vgpumgr.kinds import BACKEND_MDEV, BACKEND_MIG, BACKEND_NVIDIA_VF, BACKEND_PASSTHROUGH, BACKEND_VF  # noqa: F401


@dataclass
class Sriov:
    totalvfs: int
    numvfs: int
    vfs: list[str] = field(default_factory=list)


def unnamed(vendor: str, device: str) -> str:
    """The model name of a device that neither NVML, udev's hwdb nor pci.ids knows."""
    return f"PCI device {vendor}:{device}"


@dataclass
class Gpu:
    address: str
    vendor_id: str  # "10de"
    device_id: str
    subsystem_vendor_id: str | None
    subsystem_device_id: str | None
    class_code: str  # "0x030200"
    name: str
    driver: str | None
    numa_node: int
    iommu_group: int | None
    physfn: str | None
    sriov: Sriov | None
    backends: list[str]
    current_vgpu_type: int | None = None  # NVIDIA vendor-specific VF interface only
    nvml: dict[str, Any] | None = None

    @property
    def is_vf(self) -> bool:
        return self.physfn is not None

    @property
    def physical(self) -> str:
        """The physical GPU this function belongs to (itself for a PF)."""
        return self.physfn or self.address

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if d.get("nvml") is None:
            d.pop("nvml", None)
        return d


@dataclass
class VgpuType:
    parent: str  # PCI address or virtual parent name (mtty)
    type: str  # nvidia-232, mtty-1, i915-GVTg_V5_4
    name: str  # GRID T4-4Q
    description: str
    device_api: str
    available_instances: int
    backend: str  # mdev | nvidia-vf
    params: dict[str, str] = field(default_factory=dict)
    gpu: str | None = None  # physical GPU address (PF), None for virtual parents
    framebuffer_mb: int | None = None
    max_instance: int | None = None
    series: str | None = None
    mig_slices: int | None = None

    @property
    def short_name(self) -> str:
        return self.name.split()[-1] if self.name else self.type

    def matches(self, wanted: str) -> bool:
        """A type may be named by id (nvidia-232), full name (GRID T4-4Q) or short name (T4-4Q)."""
        w = wanted.strip()
        return w in (self.type, self.name, self.short_name) or w.lower() == self.name.lower()

    def to_json(self) -> dict[str, Any]:
        return {"parent": self.parent, "type": self.type, "name": self.name, "description": self.description,
                "device_api": self.device_api, "available_instances": self.available_instances,
                "backend": self.backend, "gpu": self.gpu,
                "framebuffer_mb": self.framebuffer_mb, "max_instance": self.max_instance, "series": self.series,
                "mig_slices": self.mig_slices}


@dataclass
class Mdev:
    uuid: str
    parent: str
    type: str
    iommu_group: int | None
    gpu: str | None = None
    placement_id: int | None = None  # mixed-size mode: its nvidia/placement_id (R570+), None when not known
    backing_vf: str | None = None  # Ascend vNPU: the SR-IOV VF the driver backs it with (hw_vdavinci/vf)

    def to_json(self) -> dict[str, Any]:
        d = _without_unknown_placement(asdict(self))
        if d.get("backing_vf") is None:
            d.pop("backing_vf", None)
        return d


@dataclass
class VfVgpu:
    """A vGPU on NVIDIA's vendor-specific VF interface: the VF with a non-zero current_vgpu_type."""

    address: str
    type: str  # nvidia-<id>
    name: str | None
    gpu: str  # physfn
    placement_id: int | None = None  # its nvidia/placement_id (R570+), None when not known

    def to_json(self) -> dict[str, Any]:
        return _without_unknown_placement(asdict(self))


def _without_unknown_placement(d: dict[str, Any]) -> dict[str, Any]:
    if d.get("placement_id") is None:
        d.pop("placement_id", None)
    return d


@dataclass
class Inventory:
    gpus: list[Gpu]
    types: list[VgpuType]
    mdevs: list[Mdev]
    vf_vgpus: list[VfVgpu]

    def gpu(self, address: str) -> Gpu | None:
        return next((g for g in self.gpus if g.address == address), None)

    def types_of(self, parent: str) -> list[VgpuType]:
        return [t for t in self.types if t.parent == parent]
