"""GPU-level pieces of the simulated host: adding a GPU, enabling VFs, refreshing what is creatable."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vgpumgr.mig import profile_for_type
from vgpumgr.sim import catalog, rules
from vgpumgr.sim.tree import SimTree, link, update, vf_address, write

# interfaces: how a GPU exposes vGPUs
MDEV_PF = "mdev-pf"  # legacy: mdev types on the physical function (T4)
MDEV_VF = "mdev-vf"  # SR-IOV GPU, mdev types on each VF (A40, A100 on kernels < 6.8)
NVIDIA_VF = "nvidia-vf"  # vendor-specific VFIO: nvidia/creatable_vgpu_types on each VF (L40S, H100)
GVTG = "gvtg"
PASSTHROUGH = "passthrough"


def add_gpu(tree: SimTree, address: str, spec: dict[str, Any]) -> None:
    """spec: model, vendor, device, subsys, numa, driver, iface, catalog (list of SimType), total_fb_mb,
    totalvfs, numvfs, mig."""
    cat = [{**asdict(t), "mig_profile": profile_for_type(t.name)} for t in spec.get("catalog", [])]
    gpu = {k: v for k, v in spec.items() if k != "catalog"}
    gpu["catalog"] = cat
    gpu.setdefault("heterogeneous", False)
    gpu.setdefault("mig", False)
    gpu.setdefault("gpu_instances", [])  # GI profile names; the driver binds one MIG-backed vGPU to each
    tree.state["gpus"][address] = gpu
    d = tree.add_pci(address, vendor=spec["vendor"], device=spec["device"], subsys=spec["subsys"],
                     cls=spec.get("class", "0x030200"), numa=spec["numa"], driver=spec.get("driver"))
    if spec.get("totalvfs"):
        write(d / "sriov_totalvfs", f"{spec['totalvfs']}\n")
        write(d / "sriov_numvfs", "0\n")
        write(d / "sriov_offset", "4\n")
        write(d / "sriov_stride", "1\n")
        write(d / "sriov_vf_device", f"{spec.get('vf_device', spec['device'])}\n")
        write(d / "sriov_drivers_autoprobe", "1\n")
    if spec["iface"] == MDEV_PF:
        tree.register_parent(address, d)
        for t in cat:
            tree.add_type(d, f"nvidia-{t['id']}", t["name"], _description(t), 0)
    elif spec["iface"] == GVTG:
        tree.register_parent(address, d)
        for name, (low, high, fence, res, weight) in catalog.GVTG_TYPES.items():
            tree.add_type(d, name, None, catalog.gvtg_description(low, high, fence, res, weight), 0)
    if spec.get("numvfs"):
        enable_vfs(tree, address, spec["numvfs"])
    refresh(tree, address)


def _description(t: dict[str, Any]) -> str:
    return (f"num_heads={t['num_heads']}, frl_config={t['frl_config']}, framebuffer={t['framebuffer_mb']}M, "
            f"max_resolution={t['max_resolution']}, max_instance={t['max_instance']}")


def vfs_of(tree: SimTree, pf: str) -> list[str]:
    d = tree.device_dir(pf)
    n = int((d / "sriov_numvfs").read_text())
    return [os.path.basename(os.readlink(d / f"virtfn{i}")) for i in range(n)]


def enable_vfs(tree: SimTree, pf: str, count: int) -> None:
    gpu = tree.state["gpus"].get(pf, {})
    pfdir = tree.device_dir(pf)
    vendor = (pfdir / "vendor").read_text().strip()[2:]
    vf_dev = (pfdir / "sriov_vf_device").read_text().strip()
    subsys = ((pfdir / "subsystem_vendor").read_text().strip()[2:],
              (pfdir / "subsystem_device").read_text().strip()[2:])
    numa = int((pfdir / "numa_node").read_text())
    cls = (pfdir / "class").read_text().strip()
    autoprobe = (pfdir / "sriov_drivers_autoprobe").read_text().strip() == "1"
    for i in range(count):
        va = vf_address(pf, i)
        driver = gpu.get("vf_driver") if autoprobe else None
        d = tree.add_pci(va, vendor=vendor, device=vf_dev, subsys=subsys, cls=cls, numa=numa, driver=driver,
                         parent_dir=pfdir.parent)
        link(d / "physfn", pfdir)
        link(pfdir / f"virtfn{i}", d)
        if gpu.get("iface") == MDEV_VF:
            tree.register_parent(va, d)
            for t in gpu["catalog"]:
                tree.add_type(d, f"nvidia-{t['id']}", t["name"], _description(t), 0)
        elif gpu.get("iface") == NVIDIA_VF:
            write(d / "nvidia/current_vgpu_type", "0\n")
            write(d / "nvidia/creatable_vgpu_types", "ID    : vGPU Name\n")
            write(d / "nvidia/vgpu_params", "\n")
            write(d / "nvidia/placement_id", "Not Applicable\n")
    write(pfdir / "sriov_numvfs", f"{count}\n")  # the callers refresh what is creatable afterwards


def disable_vfs(tree: SimTree, pf: str) -> None:
    pfdir = tree.device_dir(pf)
    for i, va in enumerate(vfs_of(tree, pf)):
        vdir = tree.device_dir(va)
        for uuid, _ in tree.mdevs_of(vdir):
            tree.remove_mdev(vdir / uuid)
        mb = tree.sys / "class/mdev_bus" / va
        if mb.is_symlink():
            mb.unlink()
        tree.remove_pci(va)
        (pfdir / f"virtfn{i}").unlink()
    write(pfdir / "sriov_numvfs", "0\n")


def existing_vgpus(tree: SimTree, pf: str) -> list[tuple[str, int]]:
    """(function or mdev uuid, type id) of the vGPUs on one physical GPU."""
    gpu = tree.state["gpus"][pf]
    out: list[tuple[str, int]] = []
    if gpu["iface"] == MDEV_PF:
        out = [(u, int(t.split("-")[1])) for u, t in tree.mdevs_of(tree.device_dir(pf))]
    elif gpu["iface"] == MDEV_VF:
        for va in vfs_of(tree, pf):
            out += [(u, int(t.split("-")[1])) for u, t in tree.mdevs_of(tree.device_dir(va))]
    elif gpu["iface"] == NVIDIA_VF:
        for va in vfs_of(tree, pf):
            cur = int((tree.device_dir(va) / "nvidia/current_vgpu_type").read_text())
            if cur:
                out.append((va, cur))
    return out


def refresh(tree: SimTree, pf: str) -> None:
    """Rewrite available_instances / creatable_vgpu_types of one physical GPU after a change."""
    gpu = tree.state["gpus"][pf]
    iface = gpu["iface"]
    if iface == GVTG:
        d = tree.device_dir(pf)
        existing = [t for _, t in tree.mdevs_of(d)]
        for name, n in rules.gvtg_available(catalog.GVTG_TYPES, catalog.GVTG_BUDGET, existing).items():
            update(d / "mdev_supported_types" / name / "available_instances", f"{n}\n")
        return
    if iface not in (MDEV_PF, MDEV_VF, NVIDIA_VF):
        return
    by_id = {t["id"]: t for t in gpu["catalog"]}
    existing = existing_vgpus(tree, pf)
    fbs = [by_id[t]["framebuffer_mb"] for _, t in existing if t in by_id and not by_id[t].get("mig_profile")]
    free_gis = list(gpu["gpu_instances"])
    for _, t in existing:
        if t in by_id and by_id[t].get("mig_profile") in free_gis:
            free_gis.remove(by_id[t]["mig_profile"])
    creatable = rules.nvidia_creatable(gpu["catalog"], fbs, mig=gpu["mig"], heterogeneous=gpu["heterogeneous"],
                                       total_fb_mb=gpu["total_fb_mb"], free_gi_profiles=free_gis)
    if iface == MDEV_PF:
        d = str(tree.device_dir(pf))
        for tid, n in creatable.items():
            update(f"{d}/mdev_supported_types/nvidia-{tid}/available_instances", f"{n}\n")
        return
    for va in vfs_of(tree, pf):
        vdir = tree.device_dir(va)
        if iface == MDEV_VF:
            busy = bool(tree.mdevs_of(vdir))
            for tid, n in creatable.items():
                update(f"{vdir}/mdev_supported_types/nvidia-{tid}/available_instances",
                       f"{0 if busy or n == 0 else 1}\n")
        else:
            busy = int((vdir / "nvidia/current_vgpu_type").read_text()) != 0
            lines = ["ID    : vGPU Name\n"]
            if not busy:
                lines += [f"{tid:<5d} : {by_id[tid]['name']}\n" for tid, n in creatable.items() if n > 0]
            update(vdir / "nvidia/creatable_vgpu_types", "".join(lines))


def physical_gpu_of(tree: SimTree, function_dir: Path) -> str | None:
    """The PF address a PCI function belongs to, if the simulator manages it."""
    physfn = function_dir / "physfn"
    address = os.path.basename(os.readlink(physfn)) if physfn.is_symlink() else function_dir.name
    return address if address in tree.state["gpus"] else None
