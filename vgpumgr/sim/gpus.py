"""GPU-level pieces of the simulated host: adding a GPU, enabling VFs, refreshing what is creatable."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vgpumgr.mig.plan import profile_for_type
from vgpumgr.sim import catalog, rules
from vgpumgr.sim import placements as simplace
from vgpumgr.sim.files import link, read_text, update, update_changed
from vgpumgr.sim.tree import SimTree, pci_files, type_files, vf_address

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
        tree.attr(d / "sriov_totalvfs", f"{spec['totalvfs']}\n")
        tree.attr(d / "sriov_numvfs", "0\n")
        tree.attr(d / "sriov_offset", "4\n")
        tree.attr(d / "sriov_stride", "1\n")
        tree.attr(d / "sriov_vf_device", f"{spec.get('vf_device', spec['device'])}\n")
        tree.attr(d / "sriov_drivers_autoprobe", "1\n")
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
    return [os.path.basename(d) for d in vf_dirs(str(tree.device_dir(pf)))]


def vf_dirs(pfdir: str) -> list[str]:
    """The real directories of a PF's VFs, from its virtfn links (relative, into real directories)."""
    n = int(read_text(f"{pfdir}/sriov_numvfs"))
    return [os.path.normpath(os.path.join(pfdir, os.readlink(f"{pfdir}/virtfn{i}"))) for i in range(n)]


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
        tree.unpark_pci(va, pfdir.parent)  # this VF's directory from before it was disabled, if kept
        d = tree.add_pci(va, vendor=vendor, device=vf_dev, subsys=subsys, cls=cls, numa=numa, driver=driver,
                         parent_dir=pfdir.parent)
        link(d / "physfn", pfdir)
        link(pfdir / f"virtfn{i}", d)
        if gpu.get("iface") == MDEV_VF:
            tree.register_parent(va, d)
            for t in gpu["catalog"]:
                tree.add_type(d, f"nvidia-{t['id']}", t["name"], _description(t), 0)
        elif gpu.get("iface") == NVIDIA_VF:
            for name, content in VF_NVIDIA_FILES.items():
                if name != "placement_id" or simplace.branch(gpu) >= 570:  # R550 has no placement_id file
                    tree.attr(d / "nvidia" / name, content)
    tree.attr(pfdir / "sriov_numvfs", f"{count}\n")  # the callers refresh what is creatable afterwards


# what a vendor-specific VF's nvidia/ folder holds when its VF appears
VF_NVIDIA_FILES = {"current_vgpu_type": "0\n", "creatable_vgpu_types": "ID    : vGPU Name\n", "vgpu_params": "\n",
                   "placement_id": "Not Applicable\n"}


def vf_entries(gpu: dict[str, Any]) -> set[str]:
    """The entries of a VF directory as enable_vfs makes it, without its driver link (relative paths): what a
    disabled VF's directory must hold, exactly, to be kept for the VF's return."""
    out = set(pci_files("0", "0", ("0", "0"), "0", 0)) | {"iommu_group", "physfn"}
    if gpu.get("iface") == MDEV_VF:
        out.add("mdev_supported_types")
        for t in gpu["catalog"]:
            td = f"mdev_supported_types/nvidia-{t['id']}"
            out |= {td, f"{td}/devices"} | {f"{td}/{f}" for f in type_files(t["name"], "-", 0)}
    elif gpu.get("iface") == NVIDIA_VF:
        r550 = simplace.branch(gpu) < 570  # no placement_id file
        out |= {"nvidia"} | {f"nvidia/{f}" for f in VF_NVIDIA_FILES if not (r550 and f == "placement_id")}
    return out


def disable_vfs(tree: SimTree, pf: str) -> None:
    pfdir = tree.device_dir(pf)
    gpu = tree.state["gpus"].get(pf)
    expected = vf_entries(gpu) if gpu else None
    for i, va in enumerate(vfs_of(tree, pf)):
        vdir = tree.device_dir(va)
        for uuid, _ in tree.mdevs_of(vdir):
            tree.remove_mdev(vdir / uuid)
        mb = tree.sys / "class/mdev_bus" / va
        if mb.is_symlink():
            mb.unlink()
        if expected is None:
            tree.remove_pci(va)
        else:
            tree.park_pci(va, expected)
        (pfdir / f"virtfn{i}").unlink()
    tree.attr(pfdir / "sriov_numvfs", "0\n")


Layout = dict[str, list[str]]  # real dir of each function that holds vGPUs -> type dirs of its vGPUs


def layout(tree: SimTree, pf: str) -> Layout:
    """Where the vGPUs of one physical GPU are: its mdevs by parent (the PF or each VF) or, for vendor-
    specific VFs, each VF's current_vgpu_type as "nvidia-<id>"."""
    iface = tree.state["gpus"][pf]["iface"]
    d = str(tree.device_dir(pf))
    if iface in (MDEV_PF, GVTG):
        return {d: [t for _, t in tree.mdevs_of(d)]}
    if iface == MDEV_VF:
        return {v: [t for _, t in tree.mdevs_of(v)] for v in vf_dirs(d)}
    if iface == NVIDIA_VF:
        out: Layout = {}
        for v in vf_dirs(d):
            cur = int(read_text(f"{v}/nvidia/current_vgpu_type"))
            out[v] = [f"nvidia-{cur}"] if cur else []
        return out
    return {}


def existing_vgpus(tree: SimTree, pf: str) -> list[tuple[str, int]]:
    """(function or mdev uuid, type id) of the vGPUs on one physical GPU."""
    iface = tree.state["gpus"][pf]["iface"]
    if iface == NVIDIA_VF:
        return [(os.path.basename(v), int(ts[0].split("-")[1])) for v, ts in layout(tree, pf).items() if ts]
    if iface not in (MDEV_PF, MDEV_VF):
        return []
    d = str(tree.device_dir(pf))
    dirs = [d] if iface == MDEV_PF else vf_dirs(d)
    return [(u, int(t.split("-")[1])) for f in dirs for u, t in tree.mdevs_of(f)]


def creatable_files(gpu: dict[str, Any], where: Layout) -> dict[str, str]:
    """What every available_instances / creatable_vgpu_types file of one physical GPU says, given where its
    vGPUs are (the driver computes them on read; the simulator keeps them as files)."""
    iface = gpu["iface"]
    if iface == GVTG:
        existing_names = [t for ts in where.values() for t in ts]
        avail = rules.gvtg_available(catalog.GVTG_TYPES, catalog.GVTG_BUDGET, existing_names)
        return {f"{d}/mdev_supported_types/{name}/available_instances": f"{n}\n"
                for d in where for name, n in avail.items()}
    if iface not in (MDEV_PF, MDEV_VF, NVIDIA_VF):
        return {}
    by_id = {t["id"]: t for t in gpu["catalog"]}
    existing = [int(t.split("-")[1]) for ts in where.values() for t in ts]
    fbs = [by_id[t]["framebuffer_mb"] for t in existing if t in by_id and not by_id[t].get("mig_profile")]
    free_gis = list(gpu["gpu_instances"])
    for t in existing:
        if t in by_id and by_id[t].get("mig_profile") in free_gis:
            free_gis.remove(by_id[t]["mig_profile"])
    creatable = rules.nvidia_creatable(gpu["catalog"], fbs, mig=gpu["mig"], heterogeneous=gpu["heterogeneous"],
                                       total_fb_mb=gpu["total_fb_mb"], free_gi_profiles=free_gis)
    if gpu["heterogeneous"] and gpu.get("arch") and not gpu["mig"]:  # mixed size: a creatable placement ID each
        room = len(existing) < simplace.pid.MAX_PER_GPU
        creatable = {t["id"]: len(simplace.creatable_ids(gpu, t)) if room and not t.get("mig_profile") else 0
                     for t in gpu["catalog"]}
    out: dict[str, str] = {}
    for d, held in where.items():
        if iface == MDEV_PF:
            for tid, n in creatable.items():
                out[f"{d}/mdev_supported_types/nvidia-{tid}/available_instances"] = f"{n}\n"
        elif iface == MDEV_VF:
            for tid, n in creatable.items():
                out[f"{d}/mdev_supported_types/nvidia-{tid}/available_instances"] = f"{0 if held or n == 0 else 1}\n"
        else:
            lines = ["ID    : vGPU Name\n"]
            if not held:
                lines += [f"{tid:<5d} : {by_id[tid]['name']}\n" for tid, n in creatable.items() if n > 0]
            out[f"{d}/nvidia/creatable_vgpu_types"] = "".join(lines)
    return out


def refresh(tree: SimTree, pf: str) -> None:
    """Rewrite available_instances / creatable_vgpu_types of one physical GPU after a change, reading what
    each file holds (for changes that may touch any of them: VFs enabled, MIG instances, a reboot)."""
    for path, content in creatable_files(tree.state["gpus"][pf], layout(tree, pf)).items():
        update(path, content)


def refresh_change(tree: SimTree, pf: str, function_dir: str, added: str | None = None,
                   removed: str | None = None) -> None:
    """The same after one vGPU of type dir `added` appeared on (or `removed` left) `function_dir`: the files
    held the values derived from the layout before it, so only the values that differ are written."""
    gpu = tree.state["gpus"][pf]
    if gpu.get("heterogeneous"):  # placements moved with the change: what was creatable before is not derivable
        refresh(tree, pf)
        return
    after = layout(tree, pf)
    before = dict(after)
    if function_dir not in after or (added is not None and added not in after[function_dir]):
        refresh(tree, pf)  # not the change the caller describes: derive every file afresh
        return
    held = list(after[function_dir])
    if added is not None:
        held.remove(added)
    if removed is not None:
        held.append(removed)
    before[function_dir] = held
    update_changed(creatable_files(gpu, before), creatable_files(gpu, after))


def physical_gpu_of(tree: SimTree, function_dir: Path | str) -> str | None:
    """The PF address a PCI function belongs to, if the simulator manages it."""
    function_dir = os.fspath(function_dir)
    try:
        address = os.path.basename(os.readlink(f"{function_dir}/physfn"))
    except OSError:  # no physfn link: a PF
        address = os.path.basename(function_dir)
    return address if address in tree.state["gpus"] else None
