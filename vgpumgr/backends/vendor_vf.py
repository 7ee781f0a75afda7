"""Vendor SR-IOV slices (AMD GIM, Intel, Cambricon): a VM gets a whole VF, which libvirt moves to vfio-pci
(managed='yes') when the VM starts. Nothing is written to make one; the checks keep two VMs off one VF."""

from __future__ import annotations

from vgpumgr import ids
from vgpumgr.backends.common import HolderCheck, device_holders, ensure_free
from vgpumgr.errors import Busy, NotFound
from vgpumgr.hostfs.root import Host


def claim(host: Host, vf: str) -> None:
    """The VF exists and nobody holds it (its VF count may have changed since the placement's snapshot)."""
    vf = ids.pci_address(vf)
    if not host.pci(vf).exists():
        raise NotFound(f"VF {vf} is gone", hint="its PF's VF count changed: `vgpumgr gpus --vfs` lists the VFs")
    ensure_free(f"VF {vf}", device_holders(host, vf), Busy)


def check_free(host: Host, vf: str, holder_check: HolderCheck | None = None) -> None:
    """Before a release: a VF a running VM holds is not given back (its record would free it for another VM)."""
    vf = ids.pci_address(vf)
    if host.pci(vf).exists():
        ensure_free(f"VF {vf}", device_holders(host, vf, holder_check), Busy)
