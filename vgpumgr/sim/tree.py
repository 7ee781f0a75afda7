"""Builds and edits a simulated sysfs tree laid out as the kernel lays it out.

Real directories live under sys/devices/...; sys/bus/pci/devices, sys/class/mdev_bus,
sys/bus/mdev/devices, iommu_groups and driver links are relative symlinks into them, exactly as on a
host. The kernel emulator (kernel.py) uses the same helpers to apply the effects of writes.

Attribute files are hard links to one file per value under VALUES_DIR (`SimTree.attr`; sim/files.py says
why and how they are written). The directories of disabled VFs are moved aside
(`park_pci`) and moved back when the VFs are enabled again (`unpark_pci`), their files then written as
for a new VF: a reboot and a restore move a directory instead of removing and making dozens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vgpumgr.hostfs.root import SIM_MARKER
from vgpumgr.sim.files import attr, entries, link, mkdir_quiet, remove_dir, rmtree, unlink_quiet

NVIDIA = "10de"
INTEL = "8086"
VALUES_DIR = ".vgpumgr-sim-values"  # one file per attribute value, hard-linked from the tree
PARKED_DIR = ".vgpumgr-sim-parked"  # directories of VFs that were disabled, kept for their return


def pci_files(vendor: str, device: str, subsys: tuple[str, str], cls: str, numa: int) -> dict[str, str]:
    """The attribute files of a PCI function the simulator makes, by name."""
    return {"vendor": f"0x{vendor}\n", "device": f"0x{device}\n", "subsystem_vendor": f"0x{subsys[0]}\n",
            "subsystem_device": f"0x{subsys[1]}\n", "class": f"{cls}\n", "numa_node": f"{numa}\n",
            "driver_override": "(null)\n", "reset_method": "flr\n",
            "local_cpulist": "0-15\n" if numa <= 0 else "16-31\n"}


def type_files(name: str | None, description: str | None, available: int) -> dict[str, str]:
    """The files of an mdev type directory (beside its devices/ directory), by name."""
    files = {"device_api": "vfio-pci\n", "available_instances": f"{available}\n", "create": ""}
    if name is not None:
        files["name"] = f"{name}\n"
    if description is not None:
        files["description"] = description if description.endswith("\n") else description + "\n"
    return files


def bdf_split(address: str) -> tuple[int, int, int, int]:
    dom, bus, rest = address.split(":")
    slot, fn = rest.split(".")
    return int(dom, 16), int(bus, 16), int(slot, 16), int(fn)


def bdf(dom: int, bus: int, slot: int, fn: int) -> str:
    return f"{dom:04x}:{bus:02x}:{slot:02x}.{fn}"


def vf_address(pf: str, index: int, offset: int = 4, stride: int = 1) -> str:
    dom, bus, slot, fn = bdf_split(pf)
    rid = (bus << 8 | slot << 3 | fn) + offset + index * stride
    return bdf(dom, rid >> 8, (rid >> 3) & 0x1F, rid & 7)


class SimTree:
    def __init__(self, root: Path, state: dict[str, Any] | None = None,
                 real_dirs: dict[str, str] | None = None) -> None:
        """`state`: the parsed state file when the caller has it already (else read on first use).
        `real_dirs`: the real paths of the bus directories, when the caller keeps them across trees (they
        are real directories the simulator never moves; os.path.realpath costs an lstat per component)."""
        self.root = Path(root)
        self.sys = self.root / "sys"
        self._state: dict[str, Any] | None = state
        self._real_dirs: dict[str, str] = {} if real_dirs is None else real_dirs
        self.dirty = False
        self.values = f"{self.root}/{VALUES_DIR}"

    # -- attribute files ------------------------------------------------------------------------
    def attr(self, path: Path | str, content: str) -> None:
        """Create or replace the attribute file `path` with `content` (a link to the file of that value)."""
        attr(self.values, path, content)

    # -- state ----------------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.root / SIM_MARKER

    @property
    def state(self) -> dict[str, Any]:
        if self._state is None:
            self._state = json.loads(self.state_path.read_text())
        return self._state

    def save(self, force: bool = False) -> None:
        """Persist the state if someone marked it changed (most writes change sysfs files only)."""
        if self._state is None or not (self.dirty or force):
            return
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, separators=(",", ":")))
        os.replace(tmp, self.state_path)

    def new_iommu_group(self) -> int:
        """The lowest free group number from 10 up: the kernel reuses the numbers of removed groups."""
        used = {int(n) for n in os.listdir(f"{self.sys}/kernel/iommu_groups") if n.isdigit()}
        n = self.state.get("first_iommu_group", 10)
        while n in used:
            n += 1
        return n

    # -- paths ----------------------------------------------------------------------------------
    def device_dir(self, address: str) -> Path:
        return self._follow("bus/pci/devices", address)

    def parent_dir(self, parent: str) -> Path:
        return self._follow("class/mdev_bus", parent)

    def _follow(self, bus: str, name: str) -> Path:
        """Where a bus link points. The links are relative and everything under sys/devices is a real
        directory, so the bus directory's real path plus the link text, normalised, is the device's real
        path: one readlink instead of realpath's lstat of every component."""
        link_path = os.path.join(self.sys, bus, name)
        try:
            target = os.readlink(link_path)
        except OSError:
            return Path(link_path).resolve()
        base = self._real_dirs.get(bus)
        if base is None:
            base = self._real_dirs[bus] = os.path.realpath(os.path.join(self.sys, bus))
        return Path(os.path.normpath(os.path.join(base, target)))

    # -- PCI functions --------------------------------------------------------------------------
    def add_pci(self, address: str, *, vendor: str, device: str, subsys: tuple[str, str], cls: str,
                numa: int, driver: str | None, parent_dir: Path | None = None) -> Path:
        dom, bus, _, _ = bdf_split(address)
        if parent_dir is None:
            if bus == 0:
                parent_dir = self.sys / f"devices/pci{dom:04x}:00"
            else:
                parent_dir = self.sys / f"devices/pci{dom:04x}:{bus - 1:02x}/{bdf(dom, bus - 1, 0, 0)}"
        d = parent_dir / address
        for name, content in pci_files(vendor, device, subsys, cls, numa).items():
            self.attr(d / name, content)
        link(self.sys / "bus/pci/devices" / address, d)
        group = self.new_iommu_group()
        gdir = self.sys / f"kernel/iommu_groups/{group}"
        link(d / "iommu_group", gdir)
        link(gdir / "devices" / address, d)
        self.attr(self.root / f"dev/vfio/.group-{group}", "")  # placeholder; /dev/vfio/<N> appears with vfio-pci
        if driver:
            self.bind(address, driver)
        return d

    def ensure_driver(self, name: str) -> Path:
        ddir = self.sys / "bus/pci/drivers" / name
        for f in ("bind", "unbind", "new_id", "remove_id"):
            if not (ddir / f).exists():
                self.attr(ddir / f, "")
        return ddir

    def bind(self, address: str, driver: str) -> None:
        d = self.device_dir(address)
        ddir = self.ensure_driver(driver)
        link(d / "driver", ddir)
        link(ddir / address, d)
        if driver == "vfio-pci":
            group = int(os.path.basename(os.readlink(d / "iommu_group")))
            self.attr(self.root / f"dev/vfio/{group}", "")

    def unbind(self, address: str) -> str | None:
        d = self.device_dir(address)
        if not (d / "driver").is_symlink():
            return None
        name = os.path.basename(os.readlink(d / "driver"))
        (d / "driver").unlink()
        dl = self.sys / "bus/pci/drivers" / name / address
        if dl.is_symlink():
            dl.unlink()
        if name == "vfio-pci":
            group = int(os.path.basename(os.readlink(d / "iommu_group")))
            vf = self.root / f"dev/vfio/{group}"
            if vf.exists():
                vf.unlink()
        return name

    def remove_pci(self, address: str) -> None:
        d = self.device_dir(address)
        self.unbind(address)
        group = os.path.basename(os.readlink(d / "iommu_group"))
        gdir = self.sys / f"kernel/iommu_groups/{group}"
        rmtree(gdir)
        ph = self.root / f"dev/vfio/.group-{group}"
        if ph.exists():
            ph.unlink()
        (self.sys / "bus/pci/devices" / address).unlink()
        rmtree(d)

    def park_pci(self, address: str, expected: set[str]) -> None:
        """remove_pci for a VF whose device goes away (sriov_numvfs 0, a reboot): its directory is moved to
        PARKED_DIR when it holds exactly `expected` (its entries without the driver link, relative to it),
        else removed. Everything outside it (bus and group links, the IOMMU group) goes as in remove_pci."""
        d = self.device_dir(address)
        self.unbind(address)
        group = os.path.basename(os.readlink(d / "iommu_group"))
        rmtree(self.sys / f"kernel/iommu_groups/{group}")
        unlink_quiet(f"{self.root}/dev/vfio/.group-{group}")
        (self.sys / "bus/pci/devices" / address).unlink()
        if entries(os.fspath(d)) != expected:
            rmtree(d)
            return
        parked = f"{self.root}/{PARKED_DIR}/{address}"
        rmtree(parked)
        try:
            os.rename(d, parked)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(parked), exist_ok=True)
            os.rename(d, parked)

    def unpark_pci(self, address: str, parent_dir: Path) -> None:
        """Move a parked VF directory back under `parent_dir`, if there is one; the caller then writes every
        entry as for a new VF (attr and link leave what is already right alone)."""
        try:
            os.rename(f"{self.root}/{PARKED_DIR}/{address}", parent_dir / address)
        except FileNotFoundError:
            pass

    def renumber_iommu_groups(self) -> dict[str, tuple[int, int]]:
        """Number the groups as a boot does: the IOMMU driver meets the PCI functions in bus order and
        gives each the lowest free number, so the survivors of a reboot get first.., first+1, ... in
        BDF order and functions created later (VFs, mdevs) take the numbers after them. Returns
        {address: (old, new)} for the functions whose number changed."""
        groups = self.sys / "kernel/iommu_groups"
        vfio = self.root / "dev/vfio"
        devices = sorted(os.listdir(self.sys / "bus/pci/devices"), key=bdf_split)
        old = {a: int(os.path.basename(os.readlink(self.device_dir(a) / "iommu_group"))) for a in devices}
        on_vfio = {a for a in devices if (self.device_dir(a) / "driver").is_symlink()
                   and os.path.basename(os.readlink(self.device_dir(a) / "driver")) == "vfio-pci"}
        for g in os.listdir(groups):  # a boot starts with no groups and no /dev/vfio nodes but the container
            rmtree(groups / g)
        for node in os.listdir(vfio):
            if node != "vfio":
                (vfio / node).unlink()
        first = self.state.get("first_iommu_group", 10)
        changed = {}
        for n, address in enumerate(devices, start=first):
            d = self.device_dir(address)
            link(d / "iommu_group", groups / str(n))
            link(groups / str(n) / "devices" / address, d)
            self.attr(vfio / f".group-{n}", "")
            if address in on_vfio:
                self.attr(vfio / str(n), "")
            if old[address] != n:
                changed[address] = (old[address], n)
        return changed

    # -- mdev parents and types -----------------------------------------------------------------
    def register_parent(self, parent: str, pdir: Path) -> None:
        link(self.sys / "class/mdev_bus" / parent, pdir)

    def add_type(self, pdir: Path, type_dir: str, name: str | None, description: str | None,
                 available: int) -> None:
        t = os.path.join(pdir, "mdev_supported_types", type_dir)
        os.makedirs(os.path.join(t, "devices"), exist_ok=True)  # once, not per file: thousands of types per host
        for fname, content in type_files(name, description, available).items():
            self.attr(os.path.join(t, fname), content)

    def add_virtual_parent(self, name: str) -> Path:
        pdir = self.sys / f"devices/virtual/{name}/{name}"
        pdir.mkdir(parents=True, exist_ok=True)
        self.attr(pdir / "uevent", "")
        self.register_parent(name, pdir)
        return pdir

    def add_mdev(self, pdir: Path | str, uuid: str, type_dir: str) -> str:
        """The mdev's directory, attributes and links, as mdev_device_create() makes them. Every path is new
        (the uuid and the IOMMU group are free), so directories are made directly, not probed for."""
        pdir, sys_dir = os.fspath(pdir), str(self.sys)
        m = f"{pdir}/{uuid}"
        type_path = f"{pdir}/mdev_supported_types/{type_dir}"
        os.mkdir(m)
        link(f"{m}/mdev_type", type_path)
        self.attr(f"{m}/remove", "")
        self.attr(f"{m}/uevent", f"DRIVER={type_dir.split('-')[0]}\n")
        group = self.new_iommu_group()
        gdir = f"{sys_dir}/kernel/iommu_groups/{group}"
        link(f"{m}/iommu_group", gdir)
        mkdir_quiet(gdir)
        mkdir_quiet(f"{gdir}/devices")
        link(f"{gdir}/devices/{uuid}", m)
        self.attr(f"{self.root}/dev/vfio/{group}", "")
        link(f"{type_path}/devices/{uuid}", m)
        link(f"{sys_dir}/bus/mdev/devices/{uuid}", m)
        if type_dir.startswith("nvidia-"):
            mkdir_quiet(f"{m}/nvidia")
            self.attr(f"{m}/nvidia/vgpu_params", "\n")
            self.attr(f"{m}/nvidia/vm_name", "\n")
        return m

    def remove_mdev(self, mdir: Path | str, group: str | None = None) -> str:
        """Undo add_mdev; returns the mdev's type dir. The entries add_mdev made are removed by name; a
        directory that holds anything else (rmdir fails) is emptied by listing it. `group`: its IOMMU group
        when the caller has read it."""
        mdir = os.fspath(mdir)
        parent, uuid = os.path.split(mdir)
        type_dir = os.path.basename(os.readlink(f"{mdir}/mdev_type"))
        if group is None:
            group = os.path.basename(os.readlink(f"{mdir}/iommu_group"))
        gdir = f"{self.sys}/kernel/iommu_groups/{group}"
        for p in (f"{parent}/mdev_supported_types/{type_dir}/devices/{uuid}", f"{self.sys}/bus/mdev/devices/{uuid}",
                  f"{self.root}/dev/vfio/{group}", f"{gdir}/devices/{uuid}"):
            unlink_quiet(p)
        remove_dir(gdir, ("devices",))
        for name in ("mdev_type", "remove", "uevent", "iommu_group", "nvidia/vgpu_params", "nvidia/vm_name"):
            unlink_quiet(f"{mdir}/{name}")
        remove_dir(mdir, ("nvidia",))
        return type_dir

    def mdevs_of(self, pdir: Path | str) -> list[tuple[str, str]]:
        """(uuid, type dir) of the mdevs under one parent."""
        out = []
        for e in os.scandir(pdir):
            if len(e.name) == 36 and e.name.count("-") == 4 and e.is_dir(follow_symlinks=False):
                out.append((e.name, os.path.basename(os.readlink(os.path.join(e.path, "mdev_type")))))
        return out
