"""Real vGPU type catalogues for the simulated host: ids, names and sources in docs/sources.md §6.

Each entry: (type id, display name, framebuffer GB (0.5 for "0"), series). num_heads, frl_config,
max_resolution and max_instance follow the series defaults and NVIDIA's rule of thumb (docs/sources.md §5,
§6.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from vgpumgr.ids import parse_type_name


@dataclass(frozen=True)
class SimType:
    id: int
    name: str
    framebuffer_mb: int
    max_instance: int
    num_heads: int
    frl_config: int
    max_resolution: str
    series: str
    mig_slices: int | None = None

    @property
    def description(self) -> str:
        return (f"num_heads={self.num_heads}, frl_config={self.frl_config}, framebuffer={self.framebuffer_mb}M, "
                f"max_resolution={self.max_resolution}, max_instance={self.max_instance}")


def _series_defaults(series: str, gb: float) -> tuple[int, int, str]:
    if series == "Q":
        return 4, 60, "5120x2880" if gb <= 1 else "7680x4320"
    if series == "B":
        return 4, 45, "5120x2880"
    if series == "A":
        return 1, 60, "1280x1024"
    return 1, 60, "4096x2160"


def make_type(type_id: int, name: str, gpu_gb: int, vf_limit: int | None = None) -> SimType:
    parsed = parse_type_name(name)
    assert parsed is not None, name
    gb = parsed.framebuffer_gb
    heads, frl, res = _series_defaults(parsed.series, gb)
    if parsed.mig_backed:
        if parsed.mig_slices == 1:  # ME slices are single; double-memory 1g slices come four to a GPU
            max_inst = 1 if parsed.attr else (4 if gb * 8 > gpu_gb else 7)
        else:
            max_inst = {2: 3, 3: 2}.get(parsed.mig_slices or 0, 1)
    else:
        max_inst = min(32, int(gpu_gb // gb))
        if vf_limit:
            max_inst = min(max_inst, vf_limit)
    return SimType(type_id, name, int(gb * 1024), max_inst, heads, frl, res, parsed.series, parsed.mig_slices)


def _table(prefix: str, gpu: str, gpu_gb: int, rows: list[tuple[int, str]], vf_limit: int | None = None
           ) -> list[SimType]:
    return [make_type(i, f"{prefix}{gpu}-{suffix}", gpu_gb, vf_limit) for i, suffix in rows]


def _seq(start: int, suffixes: str) -> list[tuple[int, str]]:
    return [(start + n, s) for n, s in enumerate(suffixes.split())]


T4 = _table("GRID ", "T4", 16, _seq(222, "1B 2B 2B4 1A 2A 4A 8A 16A 1Q 2Q 4Q 8Q 16Q") + [(252, "1B4")]
            + _seq(319, "4C 8C 16C"))

A40 = _table("NVIDIA ", "A40", 48, _seq(555, "1B 2B 1Q 2Q 3Q 4Q 6Q 8Q 12Q 16Q 24Q 48Q")
             + _seq(567, "1A 2A 3A 4A 6A 8A 12A 16A 24A 48A") + _seq(581, "4C 6C 8C 12C 16C 24C 48C"), vf_limit=32)

L40S = _table("NVIDIA ", "L40S", 48, _seq(1145, "1B 2B 1Q 2Q 3Q 4Q 6Q 8Q 12Q 16Q 24Q 48Q")
              + _seq(1157, "1A 2A 3A 4A 6A 8A 12A 16A 24A 48A") + [(2164, "3B")], vf_limit=32)

# A100 PCIe 80GB ("A100D"): time-sliced C types and MIG-backed types; names keep the GRID prefix.
A100D_TIMESLICED = _table("GRID ", "A100D", 80, _seq(692, "4C 8C 10C 16C 20C 40C 80C"), vf_limit=20)
A100D_MIG = _table("GRID ", "A100D", 80, _seq(699, "1-10C 2-20C 3-40C 4-40C 7-80C") + [(707, "1-10CME"),
                                                                                    (1054, "1-20C")])

# H100 80GB HBM3 SXM ("H100XM"), vendor-specific VF interface; MIG-backed ids from NVIDIA's open kernel
# modules (docs/sources.md §6.2).
H100XM_MIG = _table("NVIDIA ", "H100XM", 80, [(1130, "1-10CME"), (1131, "1-10C"), (1132, "1-20C"),
                                              (1133, "2-20C"), (1134, "3-40C"), (1135, "4-40C"), (1136, "7-80C")])

# Intel GVT-g (Skylake-class iGPU), types from i915's gvt/vgpu.c (docs/sources.md §8); the budget is the
# simulator's choice, so that V5_N allows N instances on an empty GPU (§17).
GVTG_TYPES = {  # type dir -> (low_gm MB, high_gm MB, fence, resolution, weight)
    "i915-GVTg_V5_1": (512, 2048, 4, "1920x1200", 16),
    "i915-GVTg_V5_2": (256, 1024, 4, "1920x1200", 8),
    "i915-GVTg_V5_4": (128, 512, 4, "1920x1200", 4),
    "i915-GVTg_V5_8": (64, 384, 4, "1024x768", 2),
}
GVTG_BUDGET = {"low_gm": 512, "high_gm": 3072, "fence": 32}


def gvtg_description(low: int, high: int, fence: int, res: str, weight: int) -> str:
    return f"low_gm_size: {low}MB\nhigh_gm_size: {high}MB\nfence: {fence}\nresolution: {res}\nweight: {weight}\n"


# Kernel sample drivers (Linux 6.1 samples/vfio-mdev), as the real-kernel lab sees them (docs/sources.md §1.1).
SAMPLE_PARENTS: dict[str, dict] = {
    "mtty": {"budget": 24, "errno": "ENOSPC", "types": {
        "mtty-1": {"name": "Single port serial", "description": None, "cost": 1},
        "mtty-2": {"name": "Dual port serial", "description": None, "cost": 2}}},
    "mdpy": {"budget": 4, "errno": "EUSERS", "types": {
        "mdpy-vga": {"name": "mdpy-vga", "description": "virtual display, 640x480 framebuffer", "cost": 1},
        "mdpy-xga": {"name": "mdpy-xga", "description": "virtual display, 1024x768 framebuffer", "cost": 1},
        "mdpy-hd": {"name": "mdpy-hd", "description": "virtual display, 1920x1080 framebuffer", "cost": 1}}},
    "mbochs": {"budget": 256, "errno": "ENOSPC", "types": {
        "mbochs-small": {"name": "mbochs-small", "description": "virtual display, 4 MB video memory", "cost": 4},
        "mbochs-medium": {"name": "mbochs-medium", "description": "virtual display, 16 MB video memory", "cost": 16},
        "mbochs-large": {"name": "mbochs-large", "description": "virtual display, 64 MB video memory", "cost": 64}}},
}
