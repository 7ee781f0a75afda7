"""Section "virtualisation": CPU flags and /dev/kvm (libvirt's checks 1-3), the IOMMU (ACPI table, kernel
groups: checks 8-9), each GPU's IOMMU group, and the VFIO and mdev modules (docs/sources.md §26)."""

from __future__ import annotations

from vgpumgr.ops.doctor.facts import Facts
from vgpumgr.ops.doctor.report import Section

TITLE = "virtualisation"
GRUB = "GRUB_CMDLINE_LINUX_DEFAULT in /etc/default/grub (then `update-grub`; Proxmox ZFS: /etc/kernel/cmdline and " \
       "`proxmox-boot-tool refresh`) and reboot"


def _vendor(f: Facts) -> str | None:
    flags = f.cpu_flags or set()
    return "intel" if "vmx" in flags else "amd" if "svm" in flags else None


def cpu_virtualisation(s: Section, f: Facts) -> None:
    check = "hardware virtualisation (CPU flags)"
    if f.cpu_flags is None:
        s.warn("cpu", check, "/proc/cpuinfo cannot be read", hint="run doctor on the host itself, with /proc mounted")
    elif _vendor(f):
        s.pass_("cpu", check, f"{'vmx' if _vendor(f) == 'intel' else 'svm'} in /proc/cpuinfo")
    else:
        s.fail("cpu", check, "no vmx or svm flag in /proc/cpuinfo: only emulated CPUs are available",
               hint="enable VT-x / AMD-V (SVM) in the BIOS/UEFI setup, or, in a VM, expose it (nested virtualisation)")


def kvm_device(s: Section, f: Facts) -> None:
    check = "/dev/kvm exists"
    if f.exists("dev/kvm"):
        s.pass_("kvm", check, "/dev/kvm present")
        return
    module = {"intel": "kvm_intel", "amd": "kvm_amd"}.get(_vendor(f) or "", "kvm_intel or kvm_amd")
    s.fail("kvm", check, "no /dev/kvm: KVM is not available",
           hint=f"load the {module} module (`modprobe {module.split()[0]}`) and enable virtualisation in the BIOS")


def iommu_table(s: Section, f: Facts) -> None:
    check = "IOMMU in the firmware (ACPI DMAR/IVRS)"
    tables = [t for t in ("DMAR", "IVRS", "IORT") if f.exists(f"sys/firmware/acpi/tables/{t}")]
    if tables:
        s.pass_("iommu.acpi", check, f"ACPI {'/'.join(tables)} table present")
    else:
        s.warn("iommu.acpi", check, "no ACPI DMAR or IVRS table: the IOMMU is off in the firmware or absent",
               hint="enable VT-d (Intel) or AMD-Vi/IOMMU in the BIOS/UEFI setup")


def iommu_groups(s: Section, f: Facts) -> None:
    check = "IOMMU enabled by the kernel"
    n = len(f.iommu_groups)
    if n:
        shown = ", ".join(f.iommu_groups[:8]) + (", ..." if n > 8 else "")
        s.pass_("iommu", check, f"{n} IOMMU group(s) with PCI devices in /sys/kernel/iommu_groups ({shown})")
        return
    param = {"intel": "intel_iommu=on iommu=pt", "amd": "amd_iommu=on iommu=pt"}.get(_vendor(f) or "",
                                                                                    "intel_iommu=on iommu=pt")
    s.fail("iommu", check, "no IOMMU group holds a PCI device: VFs and passthrough cannot be given to VMs (legacy "
                           "mdev vGPUs may still work)",
           hint=f"add {param} to {GRUB}; and enable VT-d/AMD-Vi in the BIOS")


def gpu_iommu_groups(s: Section, f: Facts) -> None:
    if not f.iommu_groups:
        return
    for g in f.physical:
        check = "IOMMU group holds only this device"
        if g.iommu_group is None:
            s.warn("iommu.group", check, "no IOMMU group", gpu=g.address,
                   hint=f"check `dmesg | grep -i iommu` for {g.address}; the IOMMU may not cover its slot")
            continue
        own = g.address.rsplit(".", 1)[0]
        others = [d for d in f.iommu_members(g.iommu_group) if d.rsplit(".", 1)[0] != own]
        if others:
            s.warn("iommu.group", check, f"group {g.iommu_group} also holds {', '.join(others)}", gpu=g.address,
                   hint="passthrough takes the whole group: move the card to a slot of its own (a CPU root port), "
                        "or enable ACS in the BIOS")
        else:
            s.pass_("iommu.group", check, f"group {g.iommu_group}", gpu=g.address)


MODULES = (("vfio", "the VFIO core"), ("vfio_iommu_type1", "VFIO's IOMMU back end"),
           ("vfio_pci", "vfio-pci (passthrough, VFs)"))


def vfio_modules(s: Section, f: Facts) -> None:
    if f.modules is None:
        s.warn("modules", "kernel modules", "/proc/modules cannot be read", hint="run doctor on the host itself")
        return
    for name, what in MODULES:
        check = f"module {name} loaded"
        if f.module_loaded(name):
            s.pass_(f"module.{name}", check, f"{what}")
        else:
            s.fail(f"module.{name}", check, f"{name} is not loaded ({what})",
                   hint=f"`modprobe {name}` and add `{name}` to /etc/modules-load.d/vfio.conf; `modprobe: FATAL: "
                        "Module not found` means a kernel without VFIO (CONFIG_VFIO)")


def mdev_module(s: Section, f: Facts) -> None:
    if f.modules is None:
        return
    check = "module mdev loaded"
    needed = [g.address for g in f.physical if "mdev" in g.backends] or f.mdev_parents()
    if f.module_loaded("mdev"):
        parents = f.mdev_parents()
        named = ", ".join(parents[:3]) + (", ..." if len(parents) > 3 else "")
        s.pass_("module.mdev", check, f"mediated devices ({len(parents)} parent(s){': ' + named if parents else ''})")
    elif needed:
        s.fail("module.mdev", check, "mdev is not loaded, but this host has mdev parents",
               hint="`modprobe mdev` (a kernel with CONFIG_VFIO_MDEV); the vendor's host driver loads it as a "
                    "dependency (nvidia_vgpu_vfio, drv_vascend)")
    else:
        s.note("module.mdev", check, "mdev is not loaded; nothing here needs it",
               hint="only mdev vGPUs (non-SR-IOV NVIDIA GPUs, kernels before 6.8, GVT-g, Ascend) need `mdev`")


CHECKS = (cpu_virtualisation, kvm_device, iommu_table, iommu_groups, gpu_iommu_groups, vfio_modules, mdev_module)
