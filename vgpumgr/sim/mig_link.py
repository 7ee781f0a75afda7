"""Keeps the simulated driver's view of MIG GPU instances in step with the simulated NVML.

On a host the vGPU driver itself knows which GPU instances exist; in the simulator sysfs and NVML
are two files, so after a GPU instance is created or destroyed through NVML the sysfs emulator is
told, and it recomputes which MIG-backed types are creatable."""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import Any

from vgpumgr.sim import gpus as simgpus
from vgpumgr.sim.tree import SimTree


def sync_from_nvml(root: Path, layer: Any) -> None:
    facts = layer.gpus()
    with open(Path(root) / ".vgpumgr-sim.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tree = SimTree(Path(root))
        for address, gpu in tree.state["gpus"].items():
            f = facts.get(address)
            if not f or not f.get("mig"):
                continue
            gpu["mig"] = f["mig"].get("current") == "enabled"
            gpu["gpu_instances"] = [gi["profile"] for gi in f["mig"].get("gpu_instances", [])]
            simgpus.refresh(tree, address)
        tree.save(force=True)
