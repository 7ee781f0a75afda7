"""Which NVML a host gets (the real library, the simulator's, or none) and merging its facts into GPUs."""

from __future__ import annotations

import sys
from typing import Any

from vgpumgr.config import Config
from vgpumgr.model import BACKEND_MIG, Gpu


def nvml_layer(cfg: Config) -> Any | None:
    """NVML for this root: the real library for "/", the one the root's kernel supplies (a simulated root's),
    else None."""
    from vgpumgr.nvml import NvmlLayer

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
    for g in gpus:
        f = facts.get(g.address)
        if f is None:
            continue
        g.nvml = f
        if (f.get("mig") or {}).get("supported") and BACKEND_MIG not in g.backends:
            g.backends.append(BACKEND_MIG)
