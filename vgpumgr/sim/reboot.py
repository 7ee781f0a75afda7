"""`vgpumgr sim reboot`: what a host reboot (or an NVIDIA driver reload) takes away, and nothing more.

What is lost, and the sources for it, in docs/sources.md §11:
- SR-IOV VFs are disabled (`sriov_numvfs` 0, no `virtfn*`, the VF functions gone): the NVIDIA driver
  does not enable them again, only `sriov-manage -e` (or a write of sriov_numvfs) does. With them go every
  VF's `current_vgpu_type` and every mdev on a VF.
- Every mdev is gone (transient devices), and so is every process that held a device.
- MIG GPU and compute instances are gone; MIG mode survives on Ampere (InfoROM), not on Hopper and newer.
  A pending MIG mode takes effect (the GPU was reset). Heterogeneous (mixed-size) vGPU mode is lost, and so
  is a vGPU scheduler set through NVML (back to best effort; only RmPVMRL in the module options persists).
- Runtime driver choices are lost: `driver_override` reads "(null)" again and every function is bound to
  its default driver; `sriov_drivers_autoprobe` is back to 1.
- IOMMU groups are numbered afresh in bus order (SimTree.renumber_iommu_groups); VFs enabled after the
  boot take the next free numbers in the order they are enabled, so a VF's group number can change.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Any

from vgpumgr.sim import gpus as simgpus
from vgpumgr.sim import placements as simplace
from vgpumgr.sim import vendor_gpus
from vgpumgr.sim.tree import SimTree


def reboot(root: Path) -> dict[str, Any]:
    """Apply a reboot to the simulated host at `root`; returns what was lost (the CLI prints it)."""
    from vgpumgr.sim.kernel import KernelEmulator

    root = Path(root)
    with open(root / ".vgpumgr-sim.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tree = SimTree(root)
        report: dict[str, Any] = {"mdevs": 0, "vf_vgpus": 0, "vfs": {}, "gpu_instances": {}, "mig_off": [],
                                  "heterogeneous_off": [], "scheduler_reset": [], "drivers": {}, "iommu_groups": {}}
        pci = tree.sys / "bus/pci/devices"
        pci.mkdir(parents=True, exist_ok=True)  # a host of virtual mdev parents only (samples) has no PCI GPU
        for address in sorted(os.listdir(pci)):
            cur = pci / address / "nvidia/current_vgpu_type"
            if cur.exists() and cur.read_text().strip() != "0":
                report["vf_vgpus"] += 1
        for link in sorted((tree.sys / "bus/mdev/devices").iterdir()):
            tree.remove_mdev(link.resolve())
            report["mdevs"] += 1
        for address in sorted(os.listdir(pci)):
            _disable_vfs(tree, address, report)
        for proc in (root / "proc").iterdir():  # no process survives a reboot (cpuinfo, modules, ... stay)
            if proc.name.isdigit():
                shutil.rmtree(proc, ignore_errors=True)
        for address in sorted(os.listdir(pci)):
            _default_driver(tree, address, report)
        report["iommu_groups"] = {a: list(v) for a, v in tree.renumber_iommu_groups().items()}
        _reset_mig(tree, report)
        vendor_gpus.reboot(tree, report)
        for pf in tree.state["gpus"]:
            simgpus.refresh(tree, pf)
        for parent in [*tree.state["samples"], *tree.state.get("vendor_parents", {})]:
            KernelEmulator.__new__(KernelEmulator)._refresh_parent(tree, tree.parent_dir(parent))
        tree.save(force=True)
    return report


def _disable_vfs(tree: SimTree, address: str, report: dict[str, Any]) -> None:
    d = tree.sys / "bus/pci/devices" / address
    if not (d / "sriov_totalvfs").exists():
        return
    numvfs = int((d / "sriov_numvfs").read_text())
    if numvfs:
        simgpus.disable_vfs(tree, address)
        report["vfs"][address] = numvfs
    if (d / "sriov_drivers_autoprobe").read_text() != "1\n":
        tree.attr(d / "sriov_drivers_autoprobe", "1\n")


def _default_driver(tree: SimTree, address: str, report: dict[str, Any]) -> None:
    d = tree.device_dir(address)
    tree.attr(d / "driver_override", "(null)\n")
    default = tree.state["gpus"].get(address, {}).get("driver")
    current = os.path.basename(os.readlink(d / "driver")) if (d / "driver").is_symlink() else None
    if current == default:
        return
    tree.unbind(address)
    if default:
        tree.bind(address, default)
    report["drivers"][address] = [current, default]


def _reset_mig(tree: SimTree, report: dict[str, Any]) -> None:
    """NVML's side first (it owns MIG state), then the driver's view in the sysfs state follows it."""
    from vgpumgr.sim.nvml import reboot_state
    from vgpumgr.sim.platform import nvml_state_path

    path = nvml_state_path(tree.root)
    lost = reboot_state(path) if path.exists() else {}
    for address, gpu in tree.state["gpus"].items():
        nv = lost.get(address)
        gis = nv["gpu_instances"] if nv else len(gpu.get("gpu_instances", []))
        if gis:
            report["gpu_instances"][address] = gis
        gpu["gpu_instances"] = []
        if nv:
            if gpu.get("mig") and not nv["mig_mode_after"][0]:
                report["mig_off"].append(address)
            gpu["mig"] = bool(nv["mig_mode_after"][0])
        if simplace.lose_mode(gpu) or (nv and nv["heterogeneous_mode"]):  # mixed-size mode and placements
            report["heterogeneous_off"].append(address)
        if nv and (nv.get("scheduler") or {}).get("policy", 1) != 1:
            report["scheduler_reset"].append(address)  # back to best effort: NVML's setting does not persist
