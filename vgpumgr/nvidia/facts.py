"""Which NVML a host gets (the real library, the simulator's, or none) and merging its facts into GPUs."""

from __future__ import annotations

import sys
from typing import Any

from vgpumgr.config import Config
from vgpumgr.model import BACKEND_MIG, Gpu, unnamed


def nvml_layer(cfg: Config) -> Any | None:
    """NVML for this root: the real library for "/", the one the root's kernel supplies (a simulated root's),
    else None."""
    from vgpumgr.nvidia.nvml import NvmlLayer

    library = cfg.host.kernel.nvml_library()
    if library is not None:
        return NvmlLayer(library)
    if cfg.host.simulated:
        return None
    if str(cfg.host.root.resolve()) == "/":
        return NvmlLayer.system()
    return None  # a copied or hand-made tree: sysfs facts only


def merge_nvml(cfg: Config, gpus: list[Gpu], quiet: bool = False) -> None:
    layer = nvml_layer(cfg)
    if layer is None:
        return
    try:
        if not layer.open():
            if layer.notice and not quiet:
                sys.stderr.write(f"note: {layer.notice}\n")
            return
        facts = layer.gpus()
    finally:
        layer.close()
    merge_facts(gpus, facts)


def merge_facts(gpus: list[Gpu], facts: dict[str, dict[str, Any]]) -> None:
    """NVML's facts per PCI address into the GPUs: MIG as a backend, and NVML's own model name.

    Names go NVML first (`NVIDIA H100 80GB HBM3`, what nvidia-smi shows), then udev's hwdb, then pci.ids
    (discovery.pci.PciNames): a host without pci.ids or hwdb entries for a new GPU still shows its model.
    A VF takes its PF's NVML name when nothing better than the bare ids named it."""
    for g in gpus:
        f = facts.get(g.address)
        if f is None:
            continue
        g.nvml = f
        name = f.get("name")
        if isinstance(name, str) and name.strip():
            g.name = name.strip()
        if (f.get("mig") or {}).get("supported") and BACKEND_MIG not in g.backends:
            g.backends.append(BACKEND_MIG)
    for g in gpus:
        pf_name = (facts.get(g.physfn) or {}).get("name") if g.physfn else None
        if isinstance(pf_name, str) and pf_name.strip() and g.name == unnamed(g.vendor_id, g.device_id):
            g.name = pf_name.strip()
