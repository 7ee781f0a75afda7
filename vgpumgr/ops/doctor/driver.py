"""Section "NVIDIA driver" (host-wide): the kernel module loaded for the running kernel, Secure Boot refusing an
unsigned one, a vGPU host driver rather than a data-center or guest driver, its version and branch
(docs/sources.md §26; causes N1, N16, N17 of the facts)."""

from __future__ import annotations

from vgpumgr.ops import support_matrix
from vgpumgr.ops.doctor.facts import Facts
from vgpumgr.ops.doctor.report import Section

TITLE = "NVIDIA driver"
VGPU_MODULE = "nvidia_vgpu_vfio"
INSTALL = "install NVIDIA's vGPU host driver for the card's branch: NVIDIA-Linux-x86_64-<version>-vgpu-kvm.run --dkms"


def module_loaded(s: Section, f: Facts) -> None:
    if not f.nvidia:
        return
    check = "nvidia kernel module loaded"
    if f.module_loaded("nvidia") or (f.modules is None and f.nvidia_version):
        s.pass_("nvidia.module", check, f"nvidia {f.nvidia_version or '(version unknown)'} on kernel "
                                        f"{f.kernel or 'unknown'}")
    elif f.secure_boot:
        s.fail("nvidia.module", check, "nvidia is not loaded and Secure Boot is on: an unsigned module is refused "
                                       "(dmesg: `Key was rejected by service`)",
               hint="sign the module with a MOK (mok_signing_key=/mok_certificate= in "
                    "/etc/dkms/framework.conf.d/*.conf, `mokutil --import` the certificate, enrol it at the next "
                    "boot), or turn Secure Boot off")
    else:
        k = f.kernel or "$(uname -r)"
        s.fail("nvidia.module", check, f"nvidia is not loaded on kernel {f.kernel or 'unknown'}: the module is not "
                                       "built for it, or failed to load (`dmesg | grep NVRM`)",
               hint=f"install linux-headers-{k} and run `dkms autoinstall -k {k}` (or reinstall the .run with "
                    "--dkms), then `modprobe nvidia`; or boot a kernel the driver was built for")


def vgpu_host_driver(s: Section, f: Facts) -> None:
    if not f.nvidia or (f.modules is not None and not f.module_loaded("nvidia")):
        return  # module_loaded said why
    check = "a vGPU host driver (nvidia_vgpu_vfio)"
    if f.module_loaded(VGPU_MODULE):
        s.pass_("nvidia.vgpu", check, f"{VGPU_MODULE} loaded")
    elif f.modules is None:
        s.warn("nvidia.vgpu", check, "/proc/modules cannot be read", hint="run doctor on the host itself")
    else:
        s.fail("nvidia.vgpu", check, f"{VGPU_MODULE} is not loaded: this is a data-center or guest driver, which "
                                     "offers no vGPU types", hint=INSTALL + "; then `modprobe nvidia_vgpu_vfio`")


def version_and_branch(s: Section, f: Facts) -> None:
    if not f.nvidia or not f.nvidia_version:
        return
    check = "driver version and branch"
    version = f.nvidia_version
    branch = support_matrix.branch_of(version)
    info = support_matrix.branch_info(branch)
    if info is None:
        s.note("nvidia.branch", check, f"{version}: branch {branch or 'unknown'} is not in the support matrix",
               hint="check NVIDIA's vGPU release notes for this driver; vgpumgr's matrix lists R525 to R595")
        return
    s.pass_("nvidia.branch", check, f"{version}: {support_matrix.release_name(branch)}, {info['kind']}, end of "
                                    f"support {info['end_of_support']}")


def kernel_breakage(s: Section, f: Facts) -> None:
    if not f.nvidia or not f.nvidia_version or not f.kernel:
        return
    rows = support_matrix.kernel_breakages(f.kernel, f.nvidia_version)
    if rows:
        r = rows[0]
        s.warn("nvidia.kernel", "driver known to work on this kernel",
               f"{f.nvidia_version} on kernel {f.kernel}: {r['what']} ({r['source']})",
               hint="boot and pin a kernel the branch supports (`proxmox-boot-tool kernel pin` or GRUB_DEFAULT), "
                    "or install a newer vGPU branch")


CHECKS = (module_loaded, vgpu_host_driver, version_and_branch, kernel_breakage)
