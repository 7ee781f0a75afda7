"""Inventories for placement tests, modelled on the boards of docs/sources.md §6.2.

`HostBuilder` adds GPUs with real type ids and names, adds vGPUs, and `build()` renders what the
driver would list at that moment (a small, independent simulation of the listing rules): legacy
mdev parents report `max_instance - count` for the size in use and 0 for other sizes; mdev VFs
report 0/1; vendor-specific VFs list only what is creatable now, and nothing once they hold a vGPU.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF, Gpu, Inventory, Mdev, Sriov, VfVgpu, VgpuType

# (id, short name, GB, max_instance)
T4_TYPES = [(222, "T4-1B", 1, 16), (223, "T4-2B", 2, 8), (224, "T4-2B4", 2, 8), (225, "T4-1A", 1, 16),
            (226, "T4-2A", 2, 8), (227, "T4-4A", 4, 4), (228, "T4-8A", 8, 2), (229, "T4-16A", 16, 1),
            (230, "T4-1Q", 1, 16), (231, "T4-2Q", 2, 8), (232, "T4-4Q", 4, 4), (233, "T4-8Q", 8, 2),
            (234, "T4-16Q", 16, 1)]
_FORTY_EIGHT = [("1B", 1), ("2B", 2), ("1Q", 1), ("2Q", 2), ("3Q", 3), ("4Q", 4), ("6Q", 6), ("8Q", 8),
                ("12Q", 12), ("16Q", 16), ("24Q", 24), ("48Q", 48)]
A40_TYPES = [(555 + i, f"A40-{suffix}", gb, min(32, 48 // gb)) for i, (suffix, gb) in enumerate(_FORTY_EIGHT)]
L40S_TYPES = [(1145 + i, f"L40S-{suffix}", gb, min(32, 48 // gb)) for i, (suffix, gb) in enumerate(_FORTY_EIGHT)]
# MIG-backed H100 80GB HBM3 SXM types: id, short name, GB, GI profile it needs
H100_MIG_TYPES = [(1130, "H100XM-1-10CME", 10, "1g.10gb+me"), (1131, "H100XM-1-10C", 10, "1g.10gb"),
                  (1132, "H100XM-1-20C", 20, "1g.20gb"), (1133, "H100XM-2-20C", 20, "2g.20gb"),
                  (1134, "H100XM-3-40C", 40, "3g.40gb"), (1135, "H100XM-4-40C", 40, "4g.40gb"),
                  (1136, "H100XM-7-80C", 80, "7g.80gb")]
GVTG_TYPES = [("i915-GVTg_V5_8", 2), ("i915-GVTg_V5_4", 1), ("i915-GVTg_V5_2", 1), ("i915-GVTg_V5_1", 1)]


def vf_addresses(pf: str, count: int) -> list[str]:
    """VFs start at function 4 of the PF's bus, stride 1 (docs/sources.md §2)."""
    domain, bus, _ = pf.split(":")
    out = []
    for n in range(count):
        fn = 4 + n
        out.append(f"{domain}:{bus}:{fn // 8:02x}.{fn % 8}")
    return out


def _desc(gb: int, max_instance: int, series: str) -> str:
    heads = 1 if series in "AC" else 4
    return (f"num_heads={heads}, frl_config=60, framebuffer={gb * 1024}M, "
            f"max_resolution=7680x4320, max_instance={max_instance}")


@dataclass
class _NvGpu:
    address: str
    prefix: str  # GRID or NVIDIA
    types: list[tuple[int, str, int, int | str]]
    mode: str  # pf-mdev | vf-mdev | vf-vendor
    vfs: list[str]
    mig: bool = False
    mixed_gb: int | None = None  # GPU size in GB when the GPU is in mixed-size mode
    vgpus: dict[str, tuple[int, str]] = field(default_factory=dict)  # parent/VF -> (type id, mdev uuid)
    pf_vgpus: list[tuple[int, str]] = field(default_factory=list)  # legacy: (type id, uuid)


class HostBuilder:
    def __init__(self) -> None:
        self.gpus: list[Gpu] = []
        self._nv: dict[str, _NvGpu] = {}
        self._generic: list[VgpuType] = []
        self._generic_mdevs: list[Mdev] = []

    # -- NVIDIA GPUs
    def _pf(self, address: str, device: str, name: str, numa: int, vfs: list[str], backend: str) -> None:
        sriov = Sriov(len(vfs), len(vfs), list(vfs)) if vfs else None
        self.gpus.append(Gpu(address, "10de", device, "10de", "0000", "0x030200", name, "nvidia", numa, 40,
                             None, sriov, [] if vfs else [backend]))
        for vf in vfs:
            self.gpus.append(Gpu(vf, "10de", device, "10de", "0000", "0x030200", name, "nvidia", numa, None,
                                 address, None, [backend]))

    def t4(self, address: str = "0000:3b:00.0", numa: int = 0) -> HostBuilder:
        self._pf(address, "1eb8", "Tesla T4", numa, [], BACKEND_MDEV)
        self._nv[address] = _NvGpu(address, "GRID", list(T4_TYPES), "pf-mdev", [])
        return self

    def a40(self, address: str = "0000:41:00.0", numa: int = 0, vfs: int = 32) -> HostBuilder:
        addrs = vf_addresses(address, vfs)
        self._pf(address, "2235", "NVIDIA A40", numa, addrs, BACKEND_MDEV)
        self._nv[address] = _NvGpu(address, "NVIDIA", list(A40_TYPES), "vf-mdev", addrs)
        return self

    def l40s(self, address: str = "0000:3d:00.0", numa: int = 0, vfs: int = 32, mixed: bool = False
             ) -> HostBuilder:
        addrs = vf_addresses(address, vfs)
        self._pf(address, "26b9", "NVIDIA L40S", numa, addrs, BACKEND_NVIDIA_VF)
        self._nv[address] = _NvGpu(address, "NVIDIA", list(L40S_TYPES), "vf-vendor", addrs,
                                   mixed_gb=48 if mixed else None)
        return self

    def h100_mig(self, address: str = "0000:65:00.0", numa: int = 0, vfs: int = 16) -> HostBuilder:
        addrs = vf_addresses(address, vfs)
        self._pf(address, "2330", "NVIDIA H100 80GB HBM3", numa, addrs, BACKEND_NVIDIA_VF)
        self._nv[address] = _NvGpu(address, "NVIDIA", list(H100_MIG_TYPES), "vf-vendor", addrs, mig=True)
        return self

    # -- other parents
    def gvtg(self, available: dict[str, int] | None = None) -> HostBuilder:
        address = "0000:00:02.0"
        self.gpus.append(Gpu(address, "8086", "3e92", "8086", "2212", "0x030000", "Intel UHD Graphics 630",
                             "i915", -1, 1, None, None, [BACKEND_MDEV]))
        avail = dict(GVTG_TYPES) | (available or {})
        for tid, _ in GVTG_TYPES:
            self._generic.append(VgpuType(address, tid, tid.split("-", 1)[1], "low_gm_size: 128MB", "vfio-pci",
                                          avail[tid], BACKEND_MDEV, gpu=address))
        return self

    def mtty(self, available: int = 2) -> HostBuilder:
        for tid, name in (("mtty-1", "Single port serial"), ("mtty-2", "Dual port serial")):
            self._generic.append(VgpuType("mtty", tid, name, "", "vfio-pci", available, BACKEND_MDEV))
        return self

    # -- vGPUs that exist on the host
    def vgpu(self, gpu: str, short: str, vf: str | None = None) -> str:
        """Create a vGPU of `short` (e.g. T4-4Q) on `gpu`; on SR-IOV GPUs on `vf` or the lowest free VF.
        Returns the mdev UUID or the VF address."""
        g = self._nv[gpu]
        tid = next(t[0] for t in g.types if t[1] == short)
        if g.mode == "pf-mdev":
            u = str(uuid.uuid4())
            g.pf_vgpus.append((tid, u))
            return u
        vf = vf or next(v for v in g.vfs if v not in g.vgpus)
        g.vgpus[vf] = (tid, str(uuid.uuid4()))
        return vf if g.mode == "vf-vendor" else g.vgpus[vf][1]

    def generic_mdev(self, parent: str, type_id: str, mdev_uuid: str | None = None) -> str:
        u = mdev_uuid or str(uuid.uuid4())
        self._generic_mdevs.append(Mdev(u, parent, type_id, None, parent if parent != "mtty" else None))
        return u

    # -- render
    def build(self) -> Inventory:
        types: list[VgpuType] = []
        mdevs: list[Mdev] = list(self._generic_mdevs)
        vf_vgpus: list[VfVgpu] = []
        for g in self._nv.values():
            existing = [tid for tid, _ in g.pf_vgpus] + [tid for tid, _ in g.vgpus.values()]
            by_id = {t[0]: t for t in g.types}
            sizes = {by_id[t][2] for t in existing}
            used_gb = sum(by_id[t][2] for t in existing)
            for tid, u in g.pf_vgpus:
                mdevs.append(Mdev(u, g.address, f"nvidia-{tid}", None, g.address))
            for vf, (tid, u) in sorted(g.vgpus.items()):
                if g.mode == "vf-mdev":
                    mdevs.append(Mdev(u, vf, f"nvidia-{tid}", None, g.address))
                else:
                    vf_vgpus.append(VfVgpu(vf, f"nvidia-{tid}", f"{g.prefix} {by_id[tid][1]}", g.address))

            def creatable(t: tuple[int, str, int, int | str], g: _NvGpu = g, sizes: set[int] = sizes,
                          existing: list[int] = existing, used_gb: int = used_gb) -> int:
                tid, _, gb, limit = t
                if g.mig:
                    return 1  # the fixture lists MIG types on free VFs; free GIs are a separate input
                if g.mixed_gb is not None:  # what still fits (placement IDs are left to the driver)
                    return 1 if used_gb + gb <= g.mixed_gb else 0
                if sizes and sizes != {gb}:
                    return 0
                return max(0, int(limit) - len(existing))

            for t in g.types:
                tid, short, gb, limit = t
                name = f"{g.prefix} {short}"
                maxi = None if isinstance(limit, str) else limit
                if g.mode == "pf-mdev":
                    types.append(self._type(g.address, g.address, tid, name, gb, maxi, creatable(t), BACKEND_MDEV))
                    continue
                for vf in g.vfs:
                    free = vf not in g.vgpus
                    avail = 1 if free and creatable(t) > 0 else 0
                    if g.mode == "vf-mdev":
                        types.append(self._type(vf, g.address, tid, name, gb, maxi, avail, BACKEND_MDEV))
                    elif avail:
                        types.append(self._type(vf, g.address, tid, name, gb, None, 1, BACKEND_NVIDIA_VF))
        return Inventory(list(self.gpus), types + list(self._generic), mdevs, vf_vgpus)

    @staticmethod
    def _type(parent: str, gpu: str, tid: int, name: str, gb: int, maxi: int | None, avail: int,
              backend: str) -> VgpuType:
        short = name.split()[-1]
        mig = short.count("-") == 2
        series = short.rstrip("ME")[-1]
        # vendor-VF listings carry only "id : name"; discovery parses the size from the name
        desc = _desc(gb, maxi, series) if backend == BACKEND_MDEV and maxi else ""
        return VgpuType(parent, f"nvidia-{tid}", name, desc, "vfio-pci", avail, backend, gpu=gpu,
                        framebuffer_mb=gb * 1024, max_instance=maxi, series=series,
                        mig_slices=int(short.split("-")[1]) if mig else None)
