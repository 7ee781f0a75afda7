"""Section "GPUs": per physical GPU, the driver bound against what its mechanism needs, the branch against the
card, SR-IOV VFs and their driver, the interface its types are on, MIG mode pending a reset, mixed-size mode as
recorded, the boot display (docs/sources.md §26; causes N2, N4, N6, N7, N8, N13, N15 of the facts)."""

from __future__ import annotations

from vgpumgr.model import BACKEND_NVIDIA_VF, Gpu
from vgpumgr.nvidia import mixed
from vgpumgr.ops import support_matrix
from vgpumgr.ops.doctor.facts import NVIDIA, VENDOR_VF_KERNEL, Facts
from vgpumgr.ops.doctor.report import Section
from vgpumgr.vendors import profiles as vendors

TITLE = "GPUs"
NOUVEAU = ("blacklist nouveau: `blacklist nouveau` and `options nouveau modeset=0` in "
           "/etc/modprobe.d/blacklist-nouveau.conf, `update-initramfs -u`, reboot")
SRIOV_MANAGE = "/usr/lib/nvidia/sriov-manage -e"


def driver_bound(s: Section, f: Facts, g: Gpu) -> None:
    check = "driver bound"
    if g.vendor_id != NVIDIA:
        p = vendors.profile(g.vendor_id, g.device_id)
        if g.driver:
            s.pass_("gpu.driver", check, f"{g.driver}", gpu=g.address)
        else:
            s.warn("gpu.driver", check, "no driver bound", gpu=g.address,
                   hint=f"load the vendor's host driver for {p.name if p else g.name} (`lspci -k -s {g.address}`); "
                        "passthrough alone needs none")
        return
    if g.driver == "nvidia":
        s.pass_("gpu.driver", check, "nvidia", gpu=g.address)
    elif g.driver == "nouveau":
        s.fail("gpu.driver", check, "nouveau owns the GPU: NVIDIA's driver cannot take it", gpu=g.address,
               hint=NOUVEAU)
    elif g.driver == "vfio-pci":
        s.warn("gpu.driver", check, "vfio-pci holds it: whole-GPU passthrough only, no vGPU types", gpu=g.address,
               hint=f"for vGPU remove 10de:{g.device_id} from vfio-pci.ids (/etc/modprobe.d/*.conf, kernel command "
                    f"line) and any driver_override, then `vgpumgr vfio unbind {g.address}`")
    else:
        s.fail("gpu.driver", check, f"{g.driver or 'no driver'} is bound, not nvidia", gpu=g.address,
               hint=f"`modprobe nvidia` (`dmesg | grep NVRM` says why it did not take {g.address}: a card this "
                    "release does not support, an unsigned module)")


def branch_supports(s: Section, f: Facts, g: Gpu) -> None:
    if g.vendor_id != NVIDIA or not f.nvidia_version:
        return
    branch = support_matrix.branch_of(f.nvidia_version)
    sup = support_matrix.support(g.device_id, branch)
    card = f"{g.name} (10de:{g.device_id})"
    check = "branch supports the card"
    words = sup.words(card, branch)
    if sup.answer == support_matrix.YES:
        s.pass_("gpu.branch", check, words, gpu=g.address)
    elif sup.answer == support_matrix.NO:
        ok = ", ".join(support_matrix.release_name(b) for b in support_matrix.supported_branches(g.device_id))
        s.fail("gpu.branch", check, words, gpu=g.address,
               hint=f"install a vGPU host driver of a branch that supports it ({ok or 'none listed'}); "
                    f"source: {sup.source}")
    elif sup.answer == support_matrix.NVAIE:
        s.note("gpu.branch", check, words, gpu=g.address,
               hint="use the NVIDIA AI Enterprise host package (…-vgpu-kvm-aie.run) and licence for this card")
    else:
        s.note("gpu.branch", check, words, gpu=g.address,
               hint="look the card up in the 'Supported GPUs' list of NVIDIA's vGPU release notes for this branch")


def sriov_vfs(s: Section, f: Facts, g: Gpu) -> None:
    if g.sriov is None or g.sriov.totalvfs == 0:
        return
    check = "SR-IOV VFs enabled"
    recorded = ((f.records or {}).get(g.address) or {}).get("numvfs")
    have = f"{g.sriov.numvfs} of {g.sriov.totalvfs} VFs enabled"
    if g.vendor_id != NVIDIA:
        p = vendors.profile(g.vendor_id, g.device_id)
        if g.sriov.numvfs or p is None or p.mechanism != vendors.SRIOV:
            s.pass_("gpu.vfs", check, have, gpu=g.address)
        else:
            s.note("gpu.vfs", check, f"no VFs enabled: {p.name} offers slices only on its VFs", gpu=g.address,
                   hint=f"`vgpumgr vendor prepare {g.address} --vfs N`")
        return
    if g.sriov.numvfs == 0:
        s.fail("gpu.vfs", check, "no VFs enabled: an SR-IOV NVIDIA GPU offers vGPU types only on its VFs (lost at "
                                 "every reboot or driver reload)" +
               (f"; {recorded} were recorded" if recorded else ""), gpu=g.address,
               hint=f"`vgpumgr restore` (it enables the recorded VFs) or `{SRIOV_MANAGE} {g.address}`; enable "
                    "vgpumgr-restore.service so a boot does it")
    elif recorded and g.sriov.numvfs < recorded:
        s.warn("gpu.vfs", check, f"{have}; {recorded} were recorded", gpu=g.address,
               hint=f"`vgpumgr restore` or `{SRIOV_MANAGE} {g.address}`")
    else:
        s.pass_("gpu.vfs", check, have, gpu=g.address)


def vf_drivers(s: Section, f: Facts, g: Gpu) -> None:
    if g.vendor_id != NVIDIA or not g.sriov or not g.sriov.numvfs:
        return
    check = "VFs on the nvidia driver"
    wrong = [v.address for v in f.vfs(g) if v.driver != "nvidia"]
    if not wrong:
        s.pass_("gpu.vf_driver", check, f"{g.sriov.numvfs} VF(s) on nvidia", gpu=g.address)
        return
    first = wrong[0]
    s.fail("gpu.vf_driver", check, f"{len(wrong)} VF(s) not on nvidia ({', '.join(wrong[:3])}"
                                   f"{', ...' if len(wrong) > 3 else ''}): they offer no vGPU types", gpu=g.address,
           hint=f"remove 10de:* VF ids from vfio-pci.ids and driver_override; `vgpumgr vfio unbind {first}` for each")


def interface(s: Section, f: Facts, g: Gpu) -> None:
    if g.vendor_id != NVIDIA or not g.sriov or not g.sriov.totalvfs:
        return
    check = "where the types are (mdev or VFs)"
    vendor_vf = BACKEND_NVIDIA_VF in g.backends
    mdev_vfs = set(f.mdev_parents()) & set(g.sriov.vfs)
    if f.kernel_tuple >= VENDOR_VF_KERNEL and not vendor_vf and not mdev_vfs and g.sriov.numvfs:
        s.warn("gpu.interface", check, f"kernel {f.kernel}: no VF has NVIDIA's vendor interface (nvidia/) nor mdev "
                                       "types",
               gpu=g.address, hint="install a vGPU 17 or newer host driver (kernel 6.8 moved SR-IOV GPUs off mdev)")
    elif vendor_vf:
        s.note("gpu.interface", check, f"kernel {f.kernel or '6.8+'}: types are on the VFs "
                                       "(<VF>/nvidia/creatable_vgpu_types), not mdev", gpu=g.address,
               hint="`mdevctl types` prints nothing here by design; `vgpumgr types` lists them")
    else:
        s.pass_("gpu.interface", check, "mdev types on the VFs (mdev_supported_types)", gpu=g.address)


def mig_pending(s: Section, f: Facts, g: Gpu) -> None:
    mig = (g.nvml or {}).get("mig") or {}
    if not mig.get("supported"):
        return
    check = "MIG mode in effect"
    if mig.get("current") == mig.get("pending"):
        s.pass_("gpu.mig", check, f"MIG {mig.get('current')}", gpu=g.address)
        return
    index = (g.nvml or {}).get("index", "N")
    s.fail("gpu.mig", check, f"MIG is {mig.get('current')} but {mig.get('pending')} is pending a GPU reset: the "
                             "types follow the mode in effect", gpu=g.address,
           hint=f"stop what holds the GPU (nvidia-persistenced, DCGM) and `nvidia-smi --gpu-reset -i {index}`, or "
                "reboot")


def mixed_mode(s: Section, f: Facts, g: Gpu) -> None:
    recorded = ((f.records or {}).get(g.address) or {}).get("vgpu_mode")
    now = mixed.mode_of(g.nvml)
    if not recorded or now is None:
        return
    check = "vGPU mode as recorded"
    if recorded == now:
        s.pass_("gpu.mode", check, f"{now}-size", gpu=g.address)
    else:
        s.warn("gpu.mode", check, f"recorded {recorded}-size, now {now}-size (lost at a reboot)", gpu=g.address,
               hint=f"`vgpumgr restore`, or `vgpumgr gpu mode {g.address} --{recorded}` while it has no vGPU")


def boot_display(s: Section, f: Facts, g: Gpu) -> None:
    if g.vendor_id != NVIDIA or (f.text(f"sys/bus/pci/devices/{g.address}/boot_vga") or "0").strip() != "1":
        return
    s.warn("gpu.boot_vga", "not the host's boot display", "the host boots on this GPU's display", gpu=g.address,
           hint="make another adapter the primary display in the BIOS: NVIDIA does not support vGPU on it")


CHECKS = (driver_bound, branch_supports, sriov_vfs, vf_drivers, interface, mig_pending, mixed_mode, boot_display)


def run(s: Section, f: Facts) -> None:
    for g in f.physical:
        for check in CHECKS:
            check(s, f, g)
