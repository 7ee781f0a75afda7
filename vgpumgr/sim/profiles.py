"""Simulated host profiles: `vgpumgr sim create DIR --profile P [--scale N]`."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vgpumgr.errors import Conflict, InvalidInput
from vgpumgr.hostfs.root import SIM_MARKER
from vgpumgr.sim import catalog, host_platform, profile_names, vendor_gpus
from vgpumgr.sim.files import write
from vgpumgr.sim.gpus import GVTG, MDEV_PF, MDEV_VF, NVIDIA_VF, add_gpu
from vgpumgr.sim.platform import mark, nvml_state_path
from vgpumgr.sim.tree import INTEL, NVIDIA, SimTree
from vgpumgr.userinput import files as userfiles

# Real names from the pci.ids database, written into the simulated root so discovery resolves them
# the same way it does on a host.
PCI_IDS = """\
10de  NVIDIA Corporation
\t1eb8  TU104GL [Tesla T4]
\t20b5  GA100 [A100 PCIe 80GB]
\t2235  GA102GL [A40]
\t2330  GH100 [H100 SXM5 80GB]
\t26b9  AD102GL [L40S]
8086  Intel Corporation
\t3e92  CoffeeLake-S GT2 [UHD Graphics 630]
\t56c0  ATS-M [Data Center GPU Flex 170]
\te211  Battlemage G21 [Arc Pro B60]
1002  Advanced Micro Devices, Inc. [AMD/ATI]
\t74a1  Aqua Vanjaram [Instinct MI300X]
\t74b5  Aqua Vanjaram [Instinct MI300X VF]
19e5  Huawei Technologies Co., Ltd.
1d94  Chengdu Haiguang IC Design Co., Ltd.
\t6211  K100_AI
1e36  Shanghai Enflame Technology Co. Ltd
\tc035  S60
1ed5  Moore Threads Technology Co.,Ltd
\t0323  MTT S4000
9999  MetaX Integrated Circuits (Shanghai) Co., Ltd.
\t0a01  C500
cabc  Cambricon
\t0370  MLU370-S4
"""


def _t4(numa: int) -> dict[str, Any]:
    return {"model": "T4", "vendor": NVIDIA, "device": "1eb8", "subsys": (NVIDIA, "12a2"), "numa": numa,
            "driver": "nvidia", "iface": MDEV_PF, "catalog": catalog.T4, "total_fb_mb": 16384}


def _a40(numa: int, vfs: int) -> dict[str, Any]:
    return {"model": "A40", "vendor": NVIDIA, "device": "2235", "subsys": (NVIDIA, "145a"), "numa": numa,
            "driver": "nvidia", "vf_driver": "nvidia", "iface": MDEV_VF, "catalog": catalog.A40,
            "total_fb_mb": 49152, "totalvfs": 32, "numvfs": vfs, "arch": "ampere"}


def _l40s(numa: int, vfs: int) -> dict[str, Any]:
    return {"model": "L40S", "vendor": NVIDIA, "device": "26b9", "subsys": (NVIDIA, "1851"), "numa": numa,
            "driver": "nvidia", "vf_driver": "nvidia", "iface": NVIDIA_VF, "catalog": catalog.L40S,
            "total_fb_mb": 49152, "totalvfs": 32, "numvfs": vfs, "nvml_profile": "l40s",
            "arch": "ada"}


def _a100(numa: int, vfs: int) -> dict[str, Any]:
    return {"model": "A100D", "vendor": NVIDIA, "device": "20b5", "subsys": (NVIDIA, "1533"), "numa": numa,
            "driver": "nvidia", "vf_driver": "nvidia", "iface": MDEV_VF,
            "catalog": catalog.A100D_TIMESLICED + catalog.A100D_MIG, "total_fb_mb": 81920,
            "totalvfs": 20, "numvfs": vfs, "mig": True, "nvml_profile": "a100-mig", "arch": "ampere"}


def _h100(numa: int, vfs: int) -> dict[str, Any]:
    return {"model": "H100XM", "vendor": NVIDIA, "device": "2330", "subsys": (NVIDIA, "16c1"), "numa": numa,
            "driver": "nvidia", "vf_driver": "nvidia", "iface": NVIDIA_VF, "catalog": catalog.H100XM_MIG,
            "total_fb_mb": 81920, "totalvfs": 32, "numvfs": vfs, "mig": True, "nvml_profile": "h100",
            "arch": "hopper"}


def _gvtg() -> dict[str, Any]:
    return {"model": "UHD630", "vendor": INTEL, "device": "3e92", "subsys": (INTEL, "2212"), "numa": -1,
            "class": "0x030000", "driver": "i915", "iface": GVTG, "total_fb_mb": 0}


class _Buses:
    """Hands out one PCI bus per GPU, each behind its own root port on the bus just below it.

    A copy asks for its profile's base bus plus two per copy; if that bus or its port's bus is taken
    (another model's GPU, another copy), it gets the next free pair above, so no two GPUs ever share
    an address and every copy keeps its own IOMMU group and NVML index."""

    def __init__(self, profile: str, scale: int) -> None:
        self.profile, self.scale = profile, scale
        self.used: set[int] = {0}  # bus 0: the root complex (GVT-g's 00:02.0 lives there)

    def take(self, preferred: int) -> int:
        bus = preferred
        while bus in self.used or bus - 1 in self.used:
            bus += 2
        if bus > 0xFF:
            raise InvalidInput(f"--scale {self.scale} is too large for profile {self.profile}: "
                               "the GPUs no longer fit on 256 PCI buses", hint="use a smaller --scale")
        self.used |= {bus, bus - 1}
        return bus


def _models(vfs: int | None) -> dict[str, list[tuple[int, Callable[[int], dict[str, Any]]]]]:
    def n(default: int) -> int:
        return default if vfs is None else vfs

    return {
        "t4": [(0x3B, _t4)],
        "a40-sriov": [(0x41, lambda numa: _a40(numa, n(32)))],
        "l40s-vfio": [(0x3D, lambda numa: _l40s(numa, n(32)))],
        "a100-mig": [(0x65, lambda numa: _a100(numa, n(20)))],
        "h100-mig": [(0x19, lambda numa: _h100(numa, n(32)))],
        "mixed": [(0x3B, lambda _: {**_t4(0), "nvml_profile": "t4"}),
                  (0x3D, lambda _: _l40s(0, n(8))), (0x65, lambda _: _a100(1, n(8)))],
    }


def _check_vfs(profile: str, vfs: int | None) -> None:
    """--vfs within what every SR-IOV GPU of the profile offers (its TotalVFs), before anything is made."""
    if vfs is None:
        return
    specs = [make(0) for _, make in _models(vfs).get(profile, [])]
    totals = [s["totalvfs"] for s in specs if s.get("totalvfs")]
    if vfs < 0 or (totals and vfs > min(totals)):
        most = min(totals) if totals else 0
        raise InvalidInput(f"--vfs {vfs}: the SR-IOV GPUs of profile {profile} have 0 to {most} VFs (TotalVFs)",
                           hint=f"give --vfs from 0 to {most}")


def _build(tree: SimTree, profile: str, scale: int, vfs: int | None) -> None:
    """Copy 0 of every model first, at the addresses a single host has; then copy 1 of each, and so on."""
    models = _models(vfs)
    if profile == "gvtg":
        add_gpu(tree, "0000:00:02.0", _gvtg())
        return
    if profile == "samples":
        add_samples(tree)
        return
    if profile in VENDOR_PROFILES:
        if scale != 1:
            raise InvalidInput(f"profile {profile} is built at --scale 1 only", hint="leave --scale out")
        if vfs is not None and profile != "all":
            raise InvalidInput(f"profile {profile} starts as its driver leaves the card after a boot",
                               hint="leave --vfs out; `vgpumgr vendor prepare BDF --vfs N` enables VFs")
        if profile == "all":
            add_gpu(tree, "0000:00:02.0", _gvtg())
            for base, make in models["mixed"]:
                add_gpu(tree, f"0000:{base:02x}:00.0", make(0 if base < 0x60 else 1))
        for name in VENDOR_PROFILES[profile]:
            VENDOR_CARDS[name](tree)
        return
    if profile not in models:
        raise InvalidInput(f"unknown simulator profile '{profile}'", hint=f"choose one of: {', '.join(PROFILES)}")
    if profile == "mixed":
        add_gpu(tree, "0000:00:02.0", _gvtg())
    buses = _Buses(profile, scale)
    plan = [(buses.take(base + 2 * copy), make, copy) for copy in range(scale) for base, make in models[profile]]
    for bus, make, copy in plan:  # all addresses first: a scale that does not fit fails before any work
        add_gpu(tree, f"0000:{bus:02x}:00.0", make(copy % 2))


# accelerators besides NVIDIA (sim/vendor_gpus.py; sources in docs/sources.md §22), each on its own bus
VENDOR_CARDS: dict[str, Callable[[SimTree], None]] = {
    "ascend-310p": lambda t: vendor_gpus.add_ascend_310p(t, "0000:81:00.0", 1),
    "ascend-910b": lambda t: vendor_gpus.add_passthrough_card(t, "0000:83:00.0", "19e5", "d802",
                                                              "devdrv_device_driver", 1),
    "mtt-s4000": lambda t: vendor_gpus.add_mtt_s4000(t, "0000:85:00.0", 1),
    "mlu370": lambda t: vendor_gpus.add_mlu370(t, "0000:87:00.0", 1),
    "mi300x": lambda t: vendor_gpus.add_mi300x(t, "0000:89:00.0", 1, vf_num=8),
    "flex170": lambda t: vendor_gpus.add_flex170(t, "0000:8b:00.0", 1),
    "bmg": lambda t: vendor_gpus.add_bmg(t, "0000:8d:00.0", 1),
    "dcu-k100": lambda t: vendor_gpus.add_passthrough_card(t, "0000:8f:00.0", "1d94", "6211", "amdgpu", 1),
    "metax-c500": lambda t: vendor_gpus.add_passthrough_card(t, "0000:91:00.0", "9999", "0a01", None, 1),
    "enflame-s60": lambda t: vendor_gpus.add_passthrough_card(t, "0000:93:00.0", "1e36", "c035", None, 1),
}
VENDOR_PROFILES: dict[str, tuple[str, ...]] = {name: (name,) for name in VENDOR_CARDS}
VENDOR_PROFILES["all"] = tuple(VENDOR_CARDS)  # with the mixed host's NVIDIA GPUs and GVT-g

PROFILES = profile_names.PROFILES
assert set(PROFILES) == {*profile_names.NVIDIA, *VENDOR_PROFILES}, "sim/profile_names.py is the one table"


def add_samples(tree: SimTree) -> None:
    """The kernel's sample mdev drivers (mtty, mdpy, mbochs), as the real-kernel lab loads them."""
    for parent, spec in catalog.SAMPLE_PARENTS.items():
        pdir = tree.add_virtual_parent(parent)
        for tname, t in spec["types"].items():
            tree.add_type(pdir, tname, t["name"], t["description"], spec["budget"] // t["cost"])
        tree.state["samples"][parent] = {"budget": spec["budget"], "errno": spec["errno"],
                                         "costs": {n: t["cost"] for n, t in spec["types"].items()}}


def _populate(root: Path, profile: str, scale: int, vfs: int | None) -> None:
    state = {"version": 1, "profile": profile, "scale": scale, "first_iommu_group": 10, "gpus": {}, "samples": {},
             "vendor_parents": {}}
    (root / SIM_MARKER).write_text(json.dumps(state))
    for d in ("sys/bus/mdev/devices", "sys/class/mdev_bus", "sys/kernel/iommu_groups", "dev/vfio", "proc"):
        (root / d).mkdir(parents=True, exist_ok=True)
    write(root / "sys/bus/pci/drivers_probe", "")
    write(root / "dev/vfio/vfio", "")
    write(root / "usr/share/misc/pci.ids", PCI_IDS)
    tree = SimTree(root)
    for drv in ("nvidia", "vfio-pci", "i915"):
        tree.ensure_driver(drv)
    _build(tree, profile, scale, vfs)
    tree.save(force=True)
    _create_nvml(root, tree)
    host_platform.populate(root, nvidia=any(g.get("vendor") == NVIDIA for g in tree.state["gpus"].values()))
    mark(root)


def _create_nvml(root: Path, tree: SimTree) -> None:
    """A simulated NVML for the GPUs that have one, with MIG mode as the sysfs side has it."""
    from vgpumgr.sim import nvml as simnvml

    gpus = [(g["nvml_profile"], a) for a, g in sorted(tree.state["gpus"].items()) if g.get("nvml_profile")]
    if not gpus:
        return
    path = nvml_state_path(root)
    simnvml.create_state(path, gpus)
    state = json.loads(path.read_text())
    for entry in state["gpus"]:
        mig = tree.state["gpus"][entry["address"]].get("mig", False)
        entry["mig_mode"] = [int(mig), int(mig)]
    simnvml.write_state(path, state)


def create(root: str | Path, profile: str, scale: int = 1, vfs: int | None = None, force: bool = False) -> Path:
    if scale < 1:
        raise InvalidInput("--scale must be at least 1")
    if profile not in PROFILES:
        raise InvalidInput(f"unknown simulator profile '{profile}'", hint=f"choose one of: {', '.join(PROFILES)}")
    _check_vfs(profile, vfs)
    root = _directory(root)
    if root.exists() and any(root.iterdir()):
        if not (root / SIM_MARKER).exists():  # never delete a directory we did not make, --force or not
            raise Conflict(f"{root} exists and is not a simulated host", hint="choose an empty or new directory")
        if not force:
            raise Conflict(f"{root} already holds a simulated host", hint="pass --force to rebuild it")
        shutil.rmtree(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise userfiles.refusal(exc, root, "create the directory") from None
    try:
        _populate(root, profile, scale, vfs)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)  # nothing half-made
        raise
    return root


def _directory(name: str | Path) -> Path:
    """The directory `sim create` builds in: new, or a directory (never a symlink, a file or a device)."""
    root = userfiles.checked_path(name, "sim create")
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return root
    except OSError as exc:
        raise userfiles.refusal(exc, root, "use") from None
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidInput(f"{root} is {userfiles.kind(st.st_mode)}, not a directory",
                           hint="name a new or empty directory")
    return root
