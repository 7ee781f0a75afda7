"""NVIDIA's vendor-specific VFIO interface: nvidia/creatable_vgpu_types and current_vgpu_type on each VF."""

from __future__ import annotations

import os

from vgpumgr import ids
from vgpumgr.discovery.fs import link_name, listdir, read, read_int, virtfns
from vgpumgr.discovery.mdev import enrich
from vgpumgr.discovery.placement_id import placement_id as read_placement_id
from vgpumgr.hostfs.root import Host
from vgpumgr.kinds import BACKEND_NVIDIA_VF

TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing (~7 ms): see cli/main.py
if TYPE_CHECKING:
    from vgpumgr.model import VfVgpu, VgpuType

HEADER = "ID    : vGPU Name"


def parse_creatable(text: str) -> list[tuple[int, str]]:
    """`ID    : vGPU Name` header, then `%-5d : name` lines; split on the first ':' (ids >= 10000 break alignment)."""
    out = []
    for line in (text or "").splitlines():
        if ":" not in line:
            continue
        left, right = line.split(":", 1)
        left = left.strip()
        if left.isdigit():
            out.append((int(left), right.strip()))
    return out


def vendor_vfs(host: Host, gpus: set[str] | None = None) -> list[str]:
    """PCI functions that expose the vendor-specific vGPU interface; with `gpus`, only those functions and
    their VFs (the PF's `virtfn*` links, as the kernel makes them), without listing the whole bus."""
    base = str(host.pci_devices)
    if gpus is None:
        candidates = listdir(base)
    else:
        pcis = [g for g in gpus if ids.is_pci_address(g)]
        candidates = sorted({*pcis, *(vf for g in pcis for vf in virtfns(f"{base}/{g}"))})
    return [a for a in candidates if os.path.exists(f"{base}/{a}/nvidia/current_vgpu_type")]


def discover_types(host: Host, parent: str | None = None) -> list[VgpuType]:
    out = []
    for vf in vendor_vfs(host, {parent} if parent else None):
        from vgpumgr.model import VgpuType  # only when the host has vendor VFs

        if parent and vf != parent:
            continue
        d = f"{host.pci_devices}/{vf}"
        gpu = link_name(f"{d}/physfn") or vf
        for tid, name in parse_creatable(read(f"{d}/nvidia/creatable_vgpu_types", "") or ""):
            out.append(enrich(VgpuType(parent=vf, type=f"nvidia-{tid}", name=name, description="",
                                       device_api="vfio-pci", available_instances=1, backend=BACKEND_NVIDIA_VF,
                                       gpu=gpu)))
    return out


def discover_vf_vgpus(host: Host, names: dict[int, str] | None = None, gpus: set[str] | None = None,
                      vfs: list[str] | None = None) -> list[VfVgpu]:
    """The VFs with a vGPU type set; with `gpus`, only the VFs of those physical GPUs (`vfs`: their
    `vendor_vfs`, when the caller has them already)."""
    from vgpumgr.model import VfVgpu

    out = []
    for vf in vendor_vfs(host, gpus) if vfs is None else vfs:
        d = f"{host.pci_devices}/{vf}"
        gpu = link_name(f"{d}/physfn") or vf
        if gpus is not None and gpu not in gpus:
            continue
        cur = read_int(f"{d}/nvidia/current_vgpu_type", 0) or 0
        if cur:
            out.append(VfVgpu(address=vf, type=f"nvidia-{cur}", name=(names or {}).get(cur), gpu=gpu,
                              placement_id=read_placement_id(d)))
    return out
