"""NVIDIA vendor-specific VF vGPUs: set and clear nvidia/current_vgpu_type on a VF."""

from __future__ import annotations

import time

from vgpumgr import ids
from vgpumgr.backends.common import HolderCheck, ensure_free, write
from vgpumgr.backends.common import device_holders as holders
from vgpumgr.discovery.fs import read, read_int
from vgpumgr.discovery.nvidia_vf import parse_creatable
from vgpumgr.errors import Busy, Conflict, InvalidInput, NoCapacity, NotFound, PermissionDenied
from vgpumgr.hostfs.root import Host


def _vf_dir(host: Host, vf: str) -> str:
    d = host.pci(vf)
    if not (d / "nvidia/current_vgpu_type").exists():
        if not d.exists():
            raise NotFound(f"no PCI device {ids.pci_address(vf)}", hint="`vgpumgr gpus --json` lists VFs")
        raise InvalidInput(f"{ids.pci_address(vf)} has no NVIDIA vendor-specific vGPU interface",
                           hint="use a VF of an SR-IOV GPU whose driver exposes nvidia/current_vgpu_type, "
                                "or the mdev commands for mdev parents")
    return str(d)


def current(host: Host, vf: str) -> int:
    return read_int(f"{_vf_dir(host, vf)}/nvidia/current_vgpu_type", 0) or 0


def creatable(host: Host, vf: str) -> list[tuple[int, str]]:
    return parse_creatable(read(f"{_vf_dir(host, vf)}/nvidia/creatable_vgpu_types", "") or "")


def set_type(host: Host, vf: str, type_id: str | int) -> int:
    vf = ids.pci_address(vf)
    tid = ids.nvidia_type_id(type_id)
    d = _vf_dir(host, vf)
    cur = current(host, vf)
    if cur == tid:
        return tid
    if cur:
        raise Conflict(f"VF {vf} already holds vGPU type nvidia-{cur}",
                       hint=f"clear it first with `vgpumgr vf clear {vf}`, or choose a free VF")
    offered = creatable(host, vf)
    if tid not in {i for i, _ in offered}:
        listing = (", ".join(f"nvidia-{i} ({n})" for i, n in offered[:8])
                   or "none (the GPU is full, or MIG needs a free GPU instance)")
        raise NoCapacity(f"type nvidia-{tid} is not creatable on VF {vf} now",
                         hint=f"creatable there: {listing}")
    write(host, host.pci(vf) / "nvidia/current_vgpu_type", str(tid), f"setting vGPU type nvidia-{tid} on {vf}")
    if read_int(f"{d}/nvidia/current_vgpu_type", 0) != tid:
        raise Conflict(f"VF {vf} did not take type nvidia-{tid}", hint="check `dmesg` for the driver's message")
    return tid


def clear_type(host: Host, vf: str, *, retries: int = 10, delay: float = 1.0,
               holder_check: HolderCheck | None = None) -> bool:
    """Write 0; retry while QEMU/the vGPU manager still let go of the VF. False if nothing was set."""
    vf = ids.pci_address(vf)
    if current(host, vf) == 0:
        return False
    ensure_free(f"VF {vf}", holders(host, vf, holder_check), Busy)
    for attempt in range(retries):
        try:
            write(host, host.pci(vf) / "nvidia/current_vgpu_type", "0", f"clearing the vGPU type of {vf}")
            return True
        except PermissionDenied:  # EPERM: nothing configured (cleared meanwhile) - that is success
            return current(host, vf) == 0 or _raise_again()
        except Busy:
            if attempt == retries - 1:
                raise
            time.sleep(delay)
    return True


def _raise_again() -> bool:
    raise Conflict("clearing the VF's vGPU type was refused", hint="check `dmesg`")
