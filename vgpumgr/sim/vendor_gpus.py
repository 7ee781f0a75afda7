"""Simulated accelerators besides NVIDIA, laid out from their vendors' driver sources and documents
(docs/sources.md §22; values the simulator had to choose are listed in §22.7):

- Huawei Ascend 310P: a vendor mdev parent on the PF (`vnpu-vir01/02/04` types with the vascend driver's
  description fields), no instances until `npu-smi set -t vnpu-mode -d 1` (emulated by sim/npu_smi.py, which
  the simulated root carries as usr/local/sbin/npu-smi); each mdev shows its backing VF in `hw_vdavinci/vf`.
- Moore Threads MTT S4000: mdev types `mtgpu-<id>` whose id encodes displays, resolution and memory.
- Cambricon MLU370, Intel Flex 170 (i915 backport, per-VF `iov/vfN/gt/lmem_quota`) and Intel Arc Pro B60
  (xe, `sriov_admin/vfN/profile/vram_quota`): SR-IOV VFs through `sriov_numvfs`.
- AMD Instinct MI300X on GIM: VFs made at module load from `vf_num` (`/sys/module/gim/parameters/vf_num`);
  GIM has no `sriov_configure`, so a `sriov_numvfs` write fails with ENOENT.
- Passthrough-only cards: Ascend 910B, Hygon DCU K100_AI, MetaX C500, Enflame S60.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vgpumgr.sim.files import link, read_text, update, write
from vgpumgr.sim.gpus import PASSTHROUGH, add_gpu, disable_vfs, enable_vfs
from vgpumgr.sim.tree import SimTree

VENDOR_MDEV = "vendor-mdev"  # mdev types on the PF, capacity kept by the vendor driver
SRIOV = "sriov"  # plain VFs
ACCEL_CLASS = "0x120000"  # processing accelerator

# Ascend 310P templates: (aicore, memory GB, aicpu, vpc, venc, vdec); cores and memory as HAMi models them
ASCEND_310P = {"vir01": (1, 3, 1, 1, 0, 1), "vir02": (2, 6, 2, 2, 1, 3), "vir04": (4, 12, 4, 4, 3, 6)}
ASCEND_BUDGET = 7  # per PF in VM mode: vir01=7, vir02=3, vir04=1 observed on a 300I Duo (docs/sources.md §22.1)
# Moore Threads S4000 (Quyuan2: at most 8 vGPUs per chip), types from vgpu_types.h
MTT_TYPES = ("mtgpu-1101", "mtgpu-1102", "mtgpu-1104", "mtgpu-1108", "mtgpu-2116", "mtgpu-2132")
MTT_MAX = 8
MTT_MEMORY_GB = 48


def _ascend_description(template: str) -> str:
    core, mem, cpu, vpc, venc, vdec = ASCEND_310P[template]
    return (f"type name: {template}\naicore num: {core}\nmemory size: {mem}GB\naicpu num: {cpu}\nvpc num: {vpc}\n"
            f"jpegd num: {vpc}\njpege num: {venc}\nvenc num: {venc}\nvdec num: {vdec}\nbar2 size: 4096KB\n"
            "bar4 size: 4096KB\n")


def _pci(vendor: str, device: str, numa: int, driver: str | None, iface: str, cls: str = ACCEL_CLASS,
         **extra: Any) -> dict[str, Any]:
    return {"model": extra.pop("model", device), "vendor": vendor, "device": device, "subsys": (vendor, "0100"),
            "numa": numa, "class": cls, "driver": driver, "iface": iface, "total_fb_mb": 0, **extra}


def add_ascend_310p(tree: SimTree, address: str, numa: int = 0) -> None:
    add_gpu(tree, address, _pci("19e5", "d500", numa, "devdrv_device_driver", VENDOR_MDEV, model="Ascend310P"))
    d = tree.device_dir(address)
    tree.register_parent(address, d)
    for t in ASCEND_310P:
        tree.add_type(d, f"vnpu-{t}", None, _ascend_description(t), 0)
        tree.attr(d / f"mdev_supported_types/vnpu-{t}/vfg_id", "0\n")
    tree.attr(d / "chip_id", "0\n")
    tree.state["vendor_parents"][address] = {"kind": "ascend", "mode": 0, "budget": ASCEND_BUDGET,
                                             "costs": {f"vnpu-{t}": v[0] for t, v in ASCEND_310P.items()},
                                             "container_vnpus": []}
    refresh_parent(tree, str(d))
    _write_npu_smi(tree.root)


def add_mtt_s4000(tree: SimTree, address: str, numa: int = 0) -> None:
    add_gpu(tree, address, _pci("1ed5", "0323", numa, "mtgpu", VENDOR_MDEV, cls="0x030200", model="MTTS4000"))
    d = tree.device_dir(address)
    tree.register_parent(address, d)
    for t in MTT_TYPES:
        tree.add_type(d, t, None, None, 0)
    tree.state["vendor_parents"][address] = {"kind": "mthreads", "max": MTT_MAX, "memory_gb": MTT_MEMORY_GB}
    refresh_parent(tree, str(d))


def add_mlu370(tree: SimTree, address: str, numa: int = 0, vfs: int = 0) -> None:
    add_gpu(tree, address, _pci("cabc", "0370", numa, "cambricon_drv", SRIOV, model="MLU370", totalvfs=4,
                                numvfs=vfs, vf_driver=None))


def add_mi300x(tree: SimTree, address: str, numa: int = 0, vf_num: int | None = None) -> None:
    """GIM loads with `vf_num` from modprobe.d (written here when given) and enables that many VFs itself."""
    if vf_num is not None:
        write(tree.root / "etc/modprobe.d/gim.conf", f"options gim vf_num={vf_num}\n")
    add_gpu(tree, address, _pci("1002", "74a1", numa, "gim", SRIOV, model="MI300X", totalvfs=8, vf_device="74b5",
                                vf_driver=None, sriov_configure=False))
    tree.ensure_driver("gim")
    gim_load(tree)


def gim_load(tree: SimTree) -> None:
    """What loading GIM does: read vf_num (default 1), enable that many VFs on each of its GPUs, set the
    partition modes that go with the count."""
    conf = read_text(f"{tree.root}/etc/modprobe.d/gim.conf") if os.path.exists(
        f"{tree.root}/etc/modprobe.d/gim.conf") else ""
    m = re.search(r"vf_num=(\d+)", conf)
    vf_num = int(m.group(1)) if m else 1
    write(tree.root / "sys/module/gim/parameters/vf_num", f"{vf_num}\n")
    modes = {1: ("SPX", "NPS1"), 2: ("DPX", "NPS1"), 4: ("QPX", "NPS1"), 8: ("CPX", "NPS4")}
    for address, gpu in sorted(tree.state["gpus"].items()):
        if gpu.get("driver") != "gim":
            continue
        acc, mem = modes.get(vf_num, ("SPX", "NPS1"))
        d = tree.device_dir(address)
        tree.attr(d / "spatial_partition_mode", f"{acc}\n")
        tree.attr(d / "memory_partition_mode", f"{mem}\n")
        if int(read_text(f"{d}/sriov_numvfs")):
            disable_vfs(tree, address)
        enable_vfs(tree, address, min(vf_num, gpu["totalvfs"]))


def add_flex170(tree: SimTree, address: str, numa: int = 0, card: int = 1) -> None:
    add_gpu(tree, address, _pci("8086", "56c0", numa, "i915", SRIOV, cls="0x038000", model="Flex170", totalvfs=31,
                                vf_driver=None, lmem_mb=16000, drm_card=card))
    d = tree.device_dir(address)
    drm = d / f"drm/card{card}"
    tree.attr(drm / "dev", f"226:{card}\n")
    link(tree.sys / f"class/drm/card{card}", drm)
    _i915_reset_quotas(tree, address)


def _i915_reset_quotas(tree: SimTree, address: str) -> None:
    gpu = tree.state["gpus"][address]
    iov = tree.device_dir(address) / f"drm/card{gpu['drm_card']}/iov"
    tree.attr(iov / "pf/gt/available/lmem_free", f"{gpu['lmem_mb'] << 20}\n")
    for n in range(1, gpu["totalvfs"] + 1):
        tree.attr(iov / f"vf{n}/gt/lmem_quota", "0\n")
        tree.attr(iov / f"vf{n}/gt/exec_quantum_ms", "0\n")


def add_bmg(tree: SimTree, address: str, numa: int = 0) -> None:
    add_gpu(tree, address, _pci("8086", "e211", numa, "xe", SRIOV, cls="0x030000", model="ArcProB60", totalvfs=8,
                                vf_driver=None, vram_mb=24576))
    _xe_reset_admin(tree, address)


def _xe_reset_admin(tree: SimTree, address: str) -> None:
    gpu = tree.state["gpus"][address]
    admin = tree.device_dir(address) / "sriov_admin"
    for fn in ["pf"] + [f"vf{n}" for n in range(1, gpu["totalvfs"] + 1)]:
        for f, v in (("exec_quantum_ms", "0"), ("preempt_timeout_us", "0"), ("sched_priority", "low")):
            tree.attr(admin / f"{fn}/profile/{f}", f"{v}\n")
        if fn != "pf":
            tree.attr(admin / f"{fn}/profile/vram_quota", "0\n")
            tree.attr(admin / f"{fn}/stop", "")
    link(admin / "pf/device", tree.device_dir(address))
    for f in ("exec_quantum_ms", "preempt_timeout_us", "sched_priority", "vram_quota"):
        tree.attr(admin / f".bulk_profile/{f}", "")


def add_passthrough_card(tree: SimTree, address: str, vendor: str, device: str, driver: str | None,
                         numa: int = 0) -> None:
    add_gpu(tree, address, _pci(vendor, device, numa, driver, PASSTHROUGH, model=f"{vendor}:{device}"))


# -- what the drivers compute ---------------------------------------------------------------------------------


def refresh_parent(tree: SimTree, pdir: str) -> bool:
    """Rewrite a vendor mdev parent's available_instances after a change; False when `pdir` is none of ours."""
    address = os.path.basename(pdir)
    vp = tree.state.get("vendor_parents", {}).get(address)
    if vp is None:
        return False
    held = [t for _, t in tree.mdevs_of(pdir)]
    if vp["kind"] == "ascend":
        left = (vp["budget"] if vp["mode"] == 1 else 0) - sum(vp["costs"][t] for t in held)
        avail = {t: max(left, 0) // c for t, c in vp["costs"].items()}
    else:
        used_gb = sum(_mtt_gb(t) for t in held)
        avail = {t: max(0, min(vp["max"] - len(held), (vp["memory_gb"] - used_gb) // _mtt_gb(t))) for t in MTT_TYPES}
    for t, n in avail.items():
        update(f"{pdir}/mdev_supported_types/{t}/available_instances", f"{n}\n")
    return True


def _err(code: int, what: str) -> OSError:
    return OSError(code, os.strerror(code), what)


def _mtt_gb(type_dir: str) -> int:
    return int(type_dir[-2:])


def after_mdev_create(tree: SimTree, pdir: str, uuid: str, type_dir: str) -> None:
    """The vascend driver's per-mdev attributes (hw_vdavinci/): its id, the device, vGroup and backing VF."""
    address = os.path.basename(pdir)
    vp = tree.state.get("vendor_parents", {}).get(address)
    if not vp or vp["kind"] != "ascend":
        return
    used = set()
    for other, _ in tree.mdevs_of(pdir):
        if other != uuid and os.path.exists(f"{pdir}/{other}/hw_vdavinci/vdavinci_id"):
            used.add(int(read_text(f"{pdir}/{other}/hw_vdavinci/vdavinci_id")))
    idx = min(set(range(16)) - used)
    from vgpumgr.sim.tree import vf_address

    m = Path(pdir) / uuid
    tree.attr(m / "hw_vdavinci/vdavinci_id", f"{idx}\n")
    tree.attr(m / "hw_vdavinci/hw_id", "Device [19e5:d500]\n")
    tree.attr(m / "hw_vdavinci/vfg_id", f"{idx // 4}\n")
    tree.attr(m / "hw_vdavinci/vf", f"{vf_address(address, idx, offset=1)}\n")


def reboot(tree: SimTree, report: dict[str, Any]) -> None:
    """What a reboot takes from the vendor cards: Ascend's vNPU mode (the vendor's boot unit sets it again),
    Intel's VF provisioning; GIM loads again with the vf_num that modprobe.d gives it."""
    for address, vp in tree.state.get("vendor_parents", {}).items():
        if vp["kind"] == "ascend":
            if vp["mode"]:
                report.setdefault("vendor", {})[address] = ("vNPU mode back to 0 (container): its vnpu types offer "
                                                            "no instances until `npu-smi set -t vnpu-mode -d 1`")
            vp["mode"] = 0
            vp["container_vnpus"] = []
    for address, gpu in tree.state["gpus"].items():
        if gpu.get("drm_card"):
            _i915_reset_quotas(tree, address)
        elif gpu.get("vram_mb"):
            _xe_reset_admin(tree, address)
    gim = [a for a, g in tree.state["gpus"].items() if g.get("driver") == "gim"]
    if gim:
        gim_load(tree)
        vf_num = read_text(f"{tree.root}/sys/module/gim/parameters/vf_num").strip()
        for address in gim:  # GIM enabled them again itself: not among the VFs a reboot leaves disabled
            report["vfs"].pop(address, None)
            report.setdefault("vendor", {})[address] = (f"GIM loaded again with vf_num={vf_num} "
                                                        "(from /etc/modprobe.d/gim.conf, else its default 1)")


# -- writes the kernel emulator hands over --------------------------------------------------------------------


def quota_write(tree: SimTree, real: str, data: str, parse: Callable[[str, str], int]) -> bool:
    """i915 `iov/vfN/gt/lmem_quota` and xe `sriov_admin/vfN/profile/vram_quota`: False when `real` is neither.
    `parse`: the kernel's kstrto (kernel.py hands it over)."""
    m = re.search(r"/drm/card\d+/iov/vf(\d+)/gt/lmem_quota$", real)
    x = re.search(r"/sriov_admin/vf(\d+)/profile/vram_quota$", real)
    if not (m or x):
        return False
    value = parse(data, os.path.basename(real))
    pfdir = real.split("/drm/card")[0] if m else real.split("/sriov_admin/")[0]
    numvfs = int(read_text(f"{pfdir}/sriov_numvfs"))
    if x:
        if numvfs:  # "initial VFs VRAM provisioning prior to VFs enabling"
            raise _err(errno.EPERM, "vram_quota")
        total = tree.state["gpus"][os.path.basename(pfdir)]["vram_mb"] << 20
        others = sum(int(read_text(f"{pfdir}/sriov_admin/vf{n}/profile/vram_quota"))
                     for n in range(1, tree.state["gpus"][os.path.basename(pfdir)]["totalvfs"] + 1)
                     if n != int(x.group(1)))
        if others + value > total:
            raise _err(errno.EINVAL, "vram_quota")
        tree.attr(real, f"{value}\n")
        return True
    free_path = re.sub(r"/iov/vf\d+/gt/lmem_quota$", "/iov/pf/gt/available/lmem_free", real)
    free, current = int(read_text(free_path)), int(read_text(real))
    if value - current > free:
        raise _err(errno.ENOSPC, "lmem_quota")
    tree.attr(free_path, f"{free - (value - current)}\n")
    tree.attr(real, f"{value}\n")
    return True


def after_enable(tree: SimTree, pf: str, count: int) -> None:
    """i915 and xe provision VFs that have no quota fairly when they are enabled; i915 shows each VF's device."""
    gpu = tree.state["gpus"].get(pf, {})
    d = tree.device_dir(pf)
    from vgpumgr.sim.gpus import vfs_of

    if gpu.get("drm_card"):
        iov = d / f"drm/card{gpu['drm_card']}/iov"
        free = int(read_text(f"{iov}/pf/gt/available/lmem_free"))
        empty = [n for n in range(1, count + 1) if int(read_text(f"{iov}/vf{n}/gt/lmem_quota")) == 0]
        share = free // len(empty) if empty else 0
        for n in empty:
            tree.attr(iov / f"vf{n}/gt/lmem_quota", f"{share}\n")
        if empty:
            tree.attr(iov / "pf/gt/available/lmem_free", f"{free - share * len(empty)}\n")
        for n, va in enumerate(vfs_of(tree, pf), start=1):
            link(iov / f"vf{n}/device", tree.device_dir(va))
    elif gpu.get("vram_mb"):
        admin = d / "sriov_admin"
        quotas = [int(read_text(f"{admin}/vf{n}/profile/vram_quota")) for n in range(1, count + 1)]
        if not any(quotas):
            share = (gpu["vram_mb"] << 20) // count
            for n in range(1, count + 1):
                tree.attr(admin / f"vf{n}/profile/vram_quota", f"{share}\n")
        for n, va in enumerate(vfs_of(tree, pf), start=1):
            link(admin / f"vf{n}/device", tree.device_dir(va))


def after_disable(tree: SimTree, pf: str) -> None:
    gpu = tree.state["gpus"].get(pf, {})
    if gpu.get("drm_card"):  # xpumanager zeroes the quotas after disabling; the links go with the VFs
        iov = tree.device_dir(pf) / f"drm/card{gpu['drm_card']}/iov"
        for n in range(1, gpu["totalvfs"] + 1):
            if os.path.islink(iov / f"vf{n}/device"):
                os.unlink(iov / f"vf{n}/device")
    elif gpu.get("vram_mb"):
        admin = tree.device_dir(pf) / "sriov_admin"
        for n in range(1, gpu["totalvfs"] + 1):
            if os.path.islink(admin / f"vf{n}/device"):
                os.unlink(admin / f"vf{n}/device")


# -- the fake vendor tool on the simulated root ---------------------------------------------------------------

NPU_SMI = "usr/local/sbin/npu-smi"


def _write_npu_smi(root: Path) -> None:
    import sys

    path = root / NPU_SMI
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n# simulated npu-smi: applies its effects to this simulated root\n"
                    "import sys\nfrom vgpumgr.sim.npu_smi import main\n"
                    f"sys.exit(main({str(root)!r}, sys.argv[1:]))\n")
    path.chmod(0o755)
