"""The emulator's mdev and vendor-VF writes change the tree exactly as the kernel's do, however they are applied.

It writes only the creatable-count files whose value a change moves (derived from the layout before and after
it) and makes and removes an mdev's entries by name: these tests hold the result to a derivation of every
file from scratch and to the full set of entries an mdev has."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import uuid as uuidlib
from pathlib import Path

import pytest
from simhost import make

from vgpumgr.hostfs.root import Host
from vgpumgr.sim import gpus as simgpus
from vgpumgr.sim.kernel import KernelEmulator
from vgpumgr.sim.tree import SimTree

COUNT_FILES = ("available_instances", "creatable_vgpu_types")


def tree_snapshot(root: Path) -> dict[str, tuple[str, str]]:
    """Every entry under root: (kind, link text or content)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            if rel.startswith(".vgpumgr"):
                continue
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir", "")
            else:
                out[rel] = ("file", Path(p).read_text())
    return out


def counts(root: Path) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, n), root): Path(d, n).read_text()
            for d, _, files in os.walk(root) for n in files if n in COUNT_FILES}


def derived_from_scratch(host: Host) -> dict[str, str]:
    """The counts after every GPU and sample parent is refreshed by reading and comparing every file."""
    tree = SimTree(host.root)
    for pf in tree.state["gpus"]:
        simgpus.refresh(tree, pf)
    for parent in tree.state["samples"]:
        KernelEmulator.__new__(KernelEmulator)._refresh_parent(tree, tree.parent_dir(parent))
    return counts(host.root)


def creatable_ids(host: Host, vf: str) -> list[int]:
    lines = (host.pci(vf) / "nvidia/creatable_vgpu_types").read_text().splitlines()[1:]
    return [int(line.split(":")[0]) for line in lines]


def random_writes(host: Host, rng: random.Random, steps: int) -> None:
    """Creates and removes of random types on random parents (and vendor-VF type sets and clears), each
    followed by a check that the counts are what a derivation from scratch gives."""
    mdev_types = [(p, t) for p in sorted(os.listdir(host.mdev_bus))
                  for t in sorted(os.listdir(host.mdev_bus / p / "mdev_supported_types"))]
    functions = os.listdir(host.pci_devices) if host.pci_devices.is_dir() else []
    vendor_vfs = sorted(a for a in functions if (host.pci(a) / "nvidia").is_dir())
    made: list[str] = []
    set_vfs: list[str] = []
    for _ in range(steps):
        roll = rng.random()
        if vendor_vfs and roll < 0.3:
            vf = rng.choice(vendor_vfs)
            ids = creatable_ids(host, vf)
            if vf in set_vfs:
                host.write(host.pci(vf) / "nvidia/current_vgpu_type", "0")
                set_vfs.remove(vf)
            elif ids:
                host.write(host.pci(vf) / "nvidia/current_vgpu_type", str(rng.choice(ids)))
                set_vfs.append(vf)
        elif mdev_types and (roll < 0.7 or not made):
            p, t = rng.choice([pt for pt in mdev_types if int(
                (host.mdev_bus / pt[0] / "mdev_supported_types" / pt[1] / "available_instances").read_text())]
                or mdev_types)
            u = str(uuidlib.UUID(int=rng.getrandbits(128), version=4))
            try:
                host.write(host.mdev_type(p, t) / "create", u)
                made.append(u)
            except OSError as e:
                assert e.errno in (errno.ENOSPC, errno.EUSERS)
        elif made:
            host.write(host.mdev(made.pop(rng.randrange(len(made)))) / "remove", "1")
        before = counts(host.root)
        assert derived_from_scratch(host) == before


@pytest.mark.parametrize("profile, kw", [("t4", {"scale": 2}), ("a40-sriov", {"vfs": 6}), ("l40s-vfio", {"vfs": 6}),
                                         ("a100-mig", {"vfs": 4}), ("samples", {}), ("gvtg", {}),
                                         ("mixed", {"vfs": 3})])
def test_counts_after_each_write_are_what_a_full_derivation_gives(tmp_path: Path, profile: str,
                                                                  kw: dict[str, int]) -> None:
    host = make(tmp_path, profile, **kw)
    random_writes(host, random.Random(profile), 40)


def test_an_mdev_has_every_entry_the_kernel_gives_it_and_its_remove_takes_them_all(tmp_path: Path) -> None:
    host = make(tmp_path, "t4")
    before = tree_snapshot(host.root)
    u = "0f6b6a2c-1d2e-4f3a-8b4c-5d6e7f8a9b0c"
    host.write(host.mdev_type("0000:3b:00.0", "nvidia-232") / "create", u.upper() + "\n")
    after = tree_snapshot(host.root)
    m = "sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/" + u
    assert {k: v for k, v in after.items() if k not in before} == {
        m: ("dir", ""),
        f"{m}/mdev_type": ("link", "../mdev_supported_types/nvidia-232"),
        f"{m}/remove": ("file", ""),
        f"{m}/uevent": ("file", "DRIVER=nvidia\n"),
        f"{m}/iommu_group": ("link", "../../../../../kernel/iommu_groups/11"),
        f"{m}/nvidia": ("dir", ""),
        f"{m}/nvidia/vgpu_params": ("file", "\n"),
        f"{m}/nvidia/vm_name": ("file", "\n"),
        "sys/kernel/iommu_groups/11": ("dir", ""),
        "sys/kernel/iommu_groups/11/devices": ("dir", ""),
        f"sys/kernel/iommu_groups/11/devices/{u}": ("link", f"../../../../{m[4:]}"),
        "dev/vfio/11": ("file", ""),
        f"{m[:-37]}/mdev_supported_types/nvidia-232/devices/{u}": ("link", f"../../../{u}"),
        f"sys/bus/mdev/devices/{u}": ("link", f"../../../{m[4:]}"),
    }
    changed = {k for k in before if after[k] != before[k]}
    assert changed and all(k.endswith("/available_instances") for k in changed)
    assert after[f"{m[:-37]}/mdev_supported_types/nvidia-232/available_instances"] == ("file", "3\n")
    host.write(host.mdev(u) / "remove", "1")
    assert tree_snapshot(host.root) == before


def test_remove_takes_what_else_is_in_the_mdev_and_its_group(tmp_path: Path) -> None:
    host = make(tmp_path, "t4")
    before = tree_snapshot(host.root)
    u = str(uuidlib.uuid4())
    host.write(host.mdev_type("0000:3b:00.0", "nvidia-232") / "create", u)
    m = host.mdev(u).resolve()
    (m / "power").mkdir()
    (m / "power/control").write_text("auto\n")
    (m / "nvidia/extra").write_text("x\n")
    (host.sys / "kernel/iommu_groups/11/type").write_text("DMA\n")
    host.write(host.mdev(u) / "remove", "1")
    assert tree_snapshot(host.root) == before


def test_writes_resolve_links_in_the_path_and_refuse_missing_entries(tmp_path: Path) -> None:
    host = make(tmp_path, "l40s-vfio", vfs=2)
    vf = "0000:3d:00.4"
    via_link = host.sys / "bus/pci/drivers/nvidia" / vf / "nvidia/current_vgpu_type"  # two links on the way
    host.write(via_link, str(creatable_ids(host, vf)[0]))
    assert (host.pci(vf) / "nvidia/current_vgpu_type").read_text() != "0\n"
    assert creatable_ids(host, vf) == []
    for missing in (host.pci(vf) / "nvidia/no_such_file", host.pci(vf) / "no_such_dir/current_vgpu_type",
                    host.pci(vf) / "vendor/current_vgpu_type", host.pci("0000:3d:00.7") / "remove"):
        with pytest.raises(OSError) as e:
            host.write(missing, "1")
        assert e.value.errno == errno.ENOENT
    with pytest.raises(OSError) as e:
        host.write(host.pci(vf) / "nvidia/creatable_vgpu_types", "1")
    assert e.value.errno == errno.EACCES


def _churn(root: str, parent: str, seed: int) -> None:
    host = Host(root)
    rng = random.Random(seed)
    for _ in range(40):
        u = str(uuidlib.UUID(int=rng.getrandbits(128), version=4))
        try:
            host.write(host.mdev_type(parent, "nvidia-232") / "create", u)
        except OSError as e:
            assert e.errno == errno.ENOSPC
            continue
        host.write(host.mdev(u) / "remove", "1")


def test_processes_writing_one_gpu_leave_its_counts_right(tmp_path: Path) -> None:
    host = make(tmp_path, "t4")
    host.write(host.mdev_type("0000:3b:00.0", "nvidia-232") / "create", str(uuidlib.uuid4()))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_churn, args=(str(host.root), "0000:3b:00.0", i)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    before = counts(host.root)
    assert before[
        "sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/mdev_supported_types/nvidia-232/available_instances"] == "3\n"
    assert derived_from_scratch(host) == before


@pytest.mark.parametrize("profile, pf", [("a40-sriov", "0000:41:00.0"), ("l40s-vfio", "0000:3d:00.0"),
                                         ("a100-mig", "0000:65:00.0")])
def test_vfs_disabled_and_enabled_again_are_as_new(tmp_path: Path, profile: str, pf: str) -> None:
    """A disabled VF's directory is kept aside and moved back when the VF returns: the tree is then the one a
    fresh build gives, whatever the VFs went through before (driver changes, vGPUs, mdevs)."""
    host = make(tmp_path, profile, vfs=4)
    fresh = tree_snapshot(host.root)
    vfs = sorted(a for a in os.listdir(host.pci_devices) if (host.pci(a) / "physfn").is_symlink())
    host.write(host.pci(vfs[0]) / "driver_override", "vfio-pci")
    if (host.pci(vfs[1]) / "nvidia/current_vgpu_type").exists():
        host.write(host.pci(vfs[1]) / "nvidia/current_vgpu_type", str(creatable_ids(host, vfs[1])[0]))
    else:
        types = sorted(os.listdir(host.mdev_bus / vfs[1] / "mdev_supported_types"))
        free = [t for t in types if int(
            (host.mdev_bus / vfs[1] / "mdev_supported_types" / t / "available_instances").read_text())]
        if free:  # (the A100 has MIG on and no GPU instance: nothing is creatable)
            host.write(host.mdev_type(vfs[1], free[0]) / "create", str(uuidlib.uuid4()))
    host.write(host.pci(pf) / "sriov_numvfs", "0")
    parked = host.root / ".vgpumgr-sim-parked"
    assert sorted(os.listdir(parked)) == vfs  # kept aside, out of sys/
    host.write(host.pci(pf) / "sriov_numvfs", "4")
    assert tree_snapshot(host.root) == fresh
    assert not os.listdir(parked)


def test_a_vf_directory_holding_anything_else_is_not_kept(tmp_path: Path) -> None:
    host = make(tmp_path, "l40s-vfio", vfs=2)
    fresh = tree_snapshot(host.root)
    (host.pci("0000:3d:00.4") / "power").mkdir()  # something the simulator did not make
    (host.pci("0000:3d:00.5") / "nvidia/extra").write_text("x\n")
    host.write(host.pci("0000:3d:00.0") / "sriov_numvfs", "0")
    assert not (host.root / ".vgpumgr-sim-parked").exists()
    host.write(host.pci("0000:3d:00.0") / "sriov_numvfs", "2")
    assert tree_snapshot(host.root) == fresh
