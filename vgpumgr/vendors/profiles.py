"""Vendor profiles: the accelerators besides NVIDIA that a VM host slices (or only passes through), as data.

A vendor is a profile over the mechanism backends, never a code path of its own: its PCI ids and names (many
are missing from pci.ids), the mechanism that gives VMs a share (mdev, SR-IOV VFs through `sriov_numvfs`, VFs
fixed by a module parameter, or whole-device passthrough only), how a slice's size is read, and the mode step
that must run before slices appear. Every fact has its public source in docs/sources.md §22; what no source
confirmed is marked `unconfirmed` here and in the README's vendor table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vgpumgr.discovery.fs import read_id
from vgpumgr.hostfs.root import Host

MDEV = "mdev"  # vendor mdev parent on the PF (Ascend vNPU, Moore Threads vGPU)
SRIOV = "sriov"  # VFs through the standard sriov_numvfs (Cambricon, Intel xe / i915 backports)
MODULE_VFS = "module-vfs"  # VFs whose count an out-of-tree PF driver fixes at load (AMD GIM vf_num)
PASSTHROUGH = "passthrough"  # whole device only

# mode steps (vgpumgr/vendors/steps.py runs, records and restores them)
STEP_ASCEND_VM_MODE = "ascend-vnpu-vm-mode"
STEP_GIM_VF_NUM = "gim-vf-num"
STEP_I915_LMEM_QUOTA = "i915-lmem-quota"
STEP_XE_VRAM_QUOTA = "xe-vram-quota"

VENDOR_NAMES = {
    "19e5": "Huawei", "1ed5": "Moore Threads", "cabc": "Cambricon", "1002": "AMD", "8086": "Intel",
    "1d94": "Hygon", "1e3e": "Iluvatar CoreX", "9999": "MetaX", "1e36": "Enflame", "1ee0": "Biren",
}

# Intel's per-VF memory quota: the smallest profile in Intel's xpumanager `vgpu.conf` is 704 MiB (Data Center GPU
# Max 1100, 63 VFs; docs/sources.md, the Flex/Max row); far below that a VF cannot hold a guest driver's contexts
MIN_VF_MEMORY_MIB = 512


@dataclass(frozen=True)
class Profile:
    vendor_id: str
    device_id: str
    model: str  # as users name the card: "Ascend 310P"
    mechanism: str
    family: str  # groups the facts below: ascend, mthreads, cambricon, amd-gim, intel-i915, intel-xe, plain
    memory_mb: int | None = None  # the card's memory, where a source gives it
    vf_device_id: str | None = None
    steps: tuple[str, ...] = ()
    templates: tuple[str, ...] = ()  # slice names the vendor documents for this card (refusal hints)
    note: str = ""  # what the README's table says about it
    unconfirmed: tuple[str, ...] = ()  # facts no source confirmed

    @property
    def name(self) -> str:
        return f"{VENDOR_NAMES.get(self.vendor_id, self.vendor_id)} {self.model}"

    @property
    def slices(self) -> bool:
        return self.mechanism != PASSTHROUGH

    @property
    def vf_slices(self) -> bool:
        """VMs get its SR-IOV VFs whole (through sriov_numvfs, or VFs its driver makes at load)."""
        return self.mechanism in (SRIOV, MODULE_VFS)


_ASCEND_910B_TEMPLATES = ("vir05_1c_16g", "vir10_3c_32g", "vir06_1c_16g", "vir12_3c_32g", "vir05_1c_8g",
                          "vir10_3c_16g", "vir10_3c_16g_nm", "vir10_4c_16g_m")
PROFILES: tuple[Profile, ...] = (
    Profile("19e5", "d500", "Ascend 310P", MDEV, "ascend", 24576, steps=(STEP_ASCEND_VM_MODE,),
            templates=("vir01", "vir02", "vir04", "vir02_1c", "vir04_3c", "vir04_3c_ndvpp", "vir04_4c_dvpp"),
            note="vNPU mdev types vnpu-virNN after `npu-smi set -t vnpu-mode -d 1`",
            unconfirmed=("PCI class and host driver name", "description line format beyond its field names")),
    Profile("19e5", "d801", "Ascend 910", MDEV, "ascend", steps=(STEP_ASCEND_VM_MODE,),
            templates=("vir02", "vir04", "vir08", "vir16"), note="listed by Huawei for vNPU->VM (static)",
            unconfirmed=("not simulated; mdev path assumed the same as 310P",)),
    Profile("19e5", "d802", "Ascend 910B", PASSTHROUGH, "plain", templates=_ASCEND_910B_TEMPLATES,
            note="VMs get the whole NPU; Huawei documents vNPUs of Atlas A2 for containers only"),
    Profile("19e5", "d803", "Ascend 910C", PASSTHROUGH, "plain", templates=_ASCEND_910B_TEMPLATES,
            note="VMs get the whole NPU; Huawei documents vNPUs of Atlas A3 for containers only"),
    Profile("1ed5", "0323", "MTT S4000", MDEV, "mthreads", 49152,
            note="mdev vGPU types of the host build of mtgpu; size and displays from the type id",
            unconfirmed=("type directory names (mtgpu-<id>)", "which SKUs ship the host vGPU build", "card memory")),
    Profile("1ed5", "0327", "MTT S4000", MDEV, "mthreads", 49152, unconfirmed=("as 0323",)),
    Profile("1ed5", "0328", "MTT S4000", MDEV, "mthreads", 49152, unconfirmed=("as 0323",)),
    Profile("1ed5", "0222", "MTT S3000", MDEV, "mthreads", unconfirmed=("as 0323; not simulated",)),
    Profile("cabc", "0370", "MLU370-S4", SRIOV, "cambricon", 24576, vf_device_id="0370",
            note="SR-IOV VFs through sriov_numvfs; a VF is 1/N of the card",
            unconfirmed=("VF count limits", "VF device id", "driver name", "card memory")),
    Profile("cabc", "0270", "MLU270-S4", SRIOV, "cambricon", unconfirmed=("as MLU370; not simulated",)),
    Profile("1002", "74a1", "Instinct MI300X", MODULE_VFS, "amd-gim", 196608, vf_device_id="74b5",
            steps=(STEP_GIM_VF_NUM,),
            note="VFs made by GIM at load (vf_num 1 = SPX/NPS1, 8 = CPX/NPS4); read and checked, never written",
            unconfirmed=("sysfs text of vf_num and memory_partition_mode", "PCI class")),
    Profile("1002", "74a5", "Instinct MI325X", MODULE_VFS, "amd-gim", vf_device_id="74b9", steps=(STEP_GIM_VF_NUM,),
            unconfirmed=("not simulated",)),
    Profile("8086", "56c0", "Data Center GPU Flex 170", SRIOV, "intel-i915", 16000, vf_device_id="56c0",
            steps=(STEP_I915_LMEM_QUOTA,), note="SR-IOV VFs (i915 backport) with per-VF lmem_quota under iov/",
            unconfirmed=("VF device id", "quota file units (bytes assumed)")),
    Profile("8086", "56c1", "Data Center GPU Flex 140", SRIOV, "intel-i915", vf_device_id="56c1",
            steps=(STEP_I915_LMEM_QUOTA,), unconfirmed=("not simulated",)),
    Profile("8086", "e211", "Arc Pro B60", SRIOV, "intel-xe", 24576, vf_device_id="e211",
            steps=(STEP_XE_VRAM_QUOTA,), note="SR-IOV VFs on xe; per-VF vram_quota under sriov_admin/ (Linux 7.0)",
            unconfirmed=("sriov_totalvfs of BMG", "VF device id")),
    Profile("8086", "e212", "Arc Pro B50", SRIOV, "intel-xe", 16384, vf_device_id="e212",
            steps=(STEP_XE_VRAM_QUOTA,), unconfirmed=("as B60; not simulated",)),
    Profile("1d94", "6211", "DCU K100_AI", PASSTHROUGH, "plain",
            note="vDCU is container-only (hy-virtual); VMs get the whole DCU"),
    Profile("9999", "0a01", "C500", PASSTHROUGH, "plain", note="sGPU is container-only; VMs get the whole GPU"),
    Profile("1e36", "c035", "S60", PASSTHROUGH, "plain", note="gcushare is container-only; VMs get the whole GCU"),
    Profile("1e36", "8001", "I20", PASSTHROUGH, "plain", note="gcushare is container-only; VMs get the whole GCU"),
)
_BY_ID = {(p.vendor_id, p.device_id): p for p in PROFILES}
_BY_VF_ID = {(p.vendor_id, p.vf_device_id): p for p in PROFILES if p.vf_device_id}
# vendors whose accelerators are not display-class devices (processing accelerators, class 0x12)
ACCELERATOR_VENDORS = frozenset({"19e5", "1ed5", "cabc", "1002", "1d94", "1e3e", "9999", "1e36", "1ee0"})
ACCELERATOR_CLASS = 0x12


def profile(vendor: str, device: str) -> Profile | None:
    """The profile of a PF (or, by its VF device id, of the card a VF belongs to)."""
    key = (vendor.lower(), device.lower())
    return _BY_ID.get(key) or _BY_VF_ID.get(key)


def ids_at(host: Host, address: str) -> tuple[str, str]:
    """(vendor id, device id) of the PCI function at `address` as sysfs gives them ("" where it does not)."""
    d = host.pci(address)
    return read_id(f"{d}/vendor") or "", read_id(f"{d}/device") or ""


def profile_at(host: Host, address: str) -> Profile | None:
    """The profile of the PCI function at `address`, read from sysfs: what every caller holding only an
    address asks (a VF by its VF device id gets its card's)."""
    return profile(*ids_at(host, address))


def name(vendor: str, device: str, vf: bool = False) -> str | None:
    """A model name for ids pci.ids lacks; vendors with no device ids known get their vendor's name."""
    p = profile(vendor, device)
    if p is not None:
        return p.name + (" VF" if vf and p.vf_device_id == device.lower() and p.mechanism != MDEV else "")
    v = VENDOR_NAMES.get(vendor.lower())
    if v and vendor.lower() in ACCELERATOR_VENDORS:
        return f"{v} accelerator {vendor}:{device}"
    return None


def is_accelerator(vendor: str, class_code: int | None) -> bool:
    """A processing accelerator of a vendor in the table (Ascend, Cambricon, ...: not display-class)."""
    return class_code is not None and (class_code >> 16) == ACCELERATOR_CLASS and vendor.lower() in ACCELERATOR_VENDORS


def passthrough_refusal(wanted: str, cards: list[tuple[str, str, str]]) -> str | None:
    """Why a slice named `wanted` cannot be had when the host's cards of a passthrough-only model match it
    (by model or a template the vendor documents for containers). `cards`: (address, vendor, device)."""
    w = wanted.lower().strip()
    for address, vendor, device in cards:
        p = profile(vendor, device)
        if p is None or p.slices:
            continue
        tokens = {p.model.lower(), p.model.lower().split()[-1], *(t.lower() for t in p.templates),
                  *(f"vnpu-{t.lower()}" for t in p.templates)}
        if w in tokens or any(len(tok) >= 4 and tok in w for tok in (p.model.lower(), p.model.lower().split()[-1])):
            return (f"{p.name} ({address}) gives VMs whole devices only ({p.note}); "
                    f"pass it through: `vgpumgr vm create NAME --passthrough {address}`")
    return None


# -- slice sizes from what the drivers expose -------------------------------------------------------------


@dataclass
class SliceFacts:
    memory_mb: int | None = None
    extra: dict[str, str] = field(default_factory=dict)  # cores, displays, partition ...


_ASCEND_MEM = re.compile(r"memory size:\s*(\d+)\s*GB", re.I)
_ASCEND_KV = re.compile(r"(?m)^\s*(aicore num|aicpu num|vpc num|venc num|vdec num):\s*(\d+)\s*$")
_MTT_TYPE = re.compile(r"^mtgpu-(\d)(\d)([0-9a-f]\d)$")
_MTT_BIG = {"a2": 128, "a6": 160, "a9": 192, "b5": 256, "e1": 512}  # >= 100 GB, from vgpu_types.h
_MTT_RES = {"1": "1K", "2": "2K", "4": "4K"}


def mdev_type_facts(type_dir: str, description: str) -> SliceFacts | None:
    """Sizes of a vendor mdev type: Ascend from its description, Moore Threads from the type id."""
    if type_dir.startswith("vnpu-"):
        m = _ASCEND_MEM.search(description)
        extra = {k.replace(" num", ""): v for k, v in _ASCEND_KV.findall(description)}
        return SliceFacts(int(m.group(1)) * 1024 if m else None, extra)
    m = _MTT_TYPE.match(type_dir)
    if m:
        heads, res, mem = m.groups()
        gb = _MTT_BIG.get(mem) if mem[0].isalpha() else int(mem)
        return SliceFacts(gb * 1024 if gb else None, {"displays": heads, "resolution": _MTT_RES.get(res, res)})
    return None


def mdev_type_name(type_dir: str, card: Profile | None) -> str | None:
    """A display name for vendor mdev types whose driver gives no `name` file."""
    if card is None or card.mechanism != MDEV:
        return None
    return f"{card.model} {type_dir}"


# AMD MI300: VF count <-> (accelerator partition, memory partition), from GIM's mi300_psp.c comment
GIM_PARTITIONS = {1: ("SPX", "NPS1"), 2: ("DPX", "NPS1"), 4: ("QPX", "NPS1"), 8: ("CPX", "NPS4")}


def vf_slice_name(card: Profile, numvfs: int) -> tuple[str, str]:
    """(type id, name) of one VF of a card with `numvfs` VFs: the slice a VM gets. The name's last word is its
    short name, as NVIDIA's (`AMD MI300X-CPX`, `Intel Flex170-1of8`)."""
    token = card.model.replace("Instinct ", "").replace("Data Center GPU ", "").replace(" ", "")
    if card.family == "amd-gim":
        acc, _ = GIM_PARTITIONS.get(numvfs, (f"{numvfs}VF", "?"))
        suffix = acc
    else:
        suffix = f"1of{numvfs}"
    vendor = VENDOR_NAMES.get(card.vendor_id, card.vendor_id)
    return f"vf-{re.sub(r'[^a-z0-9]+', '', token.lower())}_{suffix.lower()}", f"{vendor} {token}-{suffix}"


def no_vfs_hint(wanted: str, cards: list[tuple[str, str, str, int]]) -> str | None:
    """A hint when `wanted` names a VF slice of a card whose VFs are not enabled. `cards`: (address, vendor,
    device, numvfs) of SR-IOV physical functions."""
    w = wanted.lower()
    for address, vendor, device, numvfs in cards:
        p = profile(vendor, device)
        if p is None or numvfs or not p.vf_slices:
            continue
        token = vf_slice_name(p, 1)[1].split()[-1].rsplit("-", 1)[0].lower()
        if w.startswith(token) or w.startswith("vf-" + re.sub(r"[^a-z0-9]+", "", token)):
            how = (f"`vgpumgr vendor prepare {address} --vfs N`" if p.mechanism == SRIOV else
                   "GIM makes them at load (`modprobe gim vf_num=N`)")
            return f"{p.name} at {address} has no VFs enabled: {how}"
    return None
