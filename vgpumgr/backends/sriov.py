"""SR-IOV: enable and disable VFs through sriov_numvfs, with the kernel's rules checked first."""

from __future__ import annotations

from vgpumgr import ids
from vgpumgr.backends.common import vfio_holders, wait_for, write
from vgpumgr.discovery.fs import link_name, read, read_int, virtfns
from vgpumgr.errors import Busy, InvalidInput, NotFound
from vgpumgr.hostfs.root import Host


def vfs(host: Host, pf: str) -> list[str]:
    return virtfns(str(host.pci(pf)))


def _vf_in_use(host: Host, vf: str) -> str | None:
    d = host.pci(vf)
    if (read_int(f"{d}/nvidia/current_vgpu_type", 0) or 0) != 0:
        return f"VF {vf} holds a vGPU"
    if (d / "mdev_supported_types").is_dir():
        for t in (d / "mdev_supported_types").iterdir():
            if any((t / "devices").iterdir()):
                return f"VF {vf} is the parent of an mdev"
    group = link_name(f"{d}/iommu_group")
    holders = vfio_holders(host, int(group) if group and group.isdigit() else None)
    if holders:
        return f"VF {vf} is held by {', '.join(holders)}"
    return None


def set_numvfs(host: Host, pf: str, count: int, *, allow_nvidia: bool = False, timeout: float = 30.0) -> list[str]:
    pf = ids.pci_address(pf)
    d = host.pci(pf)
    if not d.exists():
        raise NotFound(f"no PCI device {pf}")
    total = read_int(f"{d}/sriov_totalvfs")
    if total is None:
        raise InvalidInput(f"{pf} is not SR-IOV capable",
                           hint="only physical functions with sriov_totalvfs can have VFs")
    if count < 0 or count > total:
        raise InvalidInput(f"{count} VFs asked for, {pf} supports 0..{total}", hint=f"choose a count up to {total}")
    if (read(f"{d}/vendor") or "").lower() == "0x10de" and not allow_nvidia:
        raise InvalidInput(f"{pf} is an NVIDIA GPU",
                           hint="enable NVIDIA VFs only with NVIDIA's script: /usr/lib/nvidia/sriov-manage -e " + pf)
    current = read_int(f"{d}/sriov_numvfs", 0) or 0
    if current == count:
        return vfs(host, pf)
    if not (d / "driver").is_symlink():
        raise InvalidInput(f"no driver is bound to {pf}",
                           hint="sriov_numvfs needs the PF's own driver (it implements sriov_configure); bind it first")
    if current:
        busy = [r for r in (_vf_in_use(host, v) for v in vfs(host, pf)) if r]
        if busy:
            raise Busy(f"cannot change the VF count of {pf}: {'; '.join(busy)}",
                       hint="stop the VMs and remove the vGPUs on its VFs first")
        # the kernel refuses a non-zero to non-zero change (EBUSY): go through 0
        write(host, d / "sriov_numvfs", "0", f"disabling the VFs of {pf}", timeout=timeout)
    if count:
        write(host, d / "sriov_numvfs", str(count), f"enabling {count} VFs on {pf}", timeout=timeout)
        wait_for(lambda: len(vfs(host, pf)) == count, timeout)
    return vfs(host, pf)
