"""Vendor SR-IOV slices: each VF of a card whose vendor profile gives VMs whole VFs (AMD GIM, Intel xe/i915,
Cambricon) listed as one type instance on that VF, sized from what the driver exposes (Intel's per-VF quota,
AMD's partition mode and VF count, else an equal share of the card)."""

from __future__ import annotations

from vgpumgr.discovery.fs import link_name, listdir, read, read_int, virtfns
from vgpumgr.hostfs.root import Host
from vgpumgr.kinds import BACKEND_VF
from vgpumgr.vendors import profiles as vendors
from vgpumgr.vendors.quota_paths import quota_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from vgpumgr.model import VgpuType


def card_of(host: Host, pf: str) -> vendors.Profile | None:
    p = vendors.profile_at(host, pf)
    return p if p is not None and p.vf_slices else None


def vf_quota_mb(host: Host, pf: str, card: vendors.Profile, index: int) -> int | None:
    """The memory the driver provisioned for VF `index` (1-based), where it says so."""
    path = quota_path(host, pf, card, index)
    q = read_int(path) if path else None
    return None if q is None else q >> 20


def slice_facts(host: Host, pf: str, card: vendors.Profile, index: int, numvfs: int) -> tuple[int | None, dict]:
    params: dict[str, str] = {"vendor": card.name}
    mem = vf_quota_mb(host, pf, card, index)
    if card.family == "amd-gim":
        d = host.pci(pf)
        params["spatial_partition_mode"] = read(f"{d}/spatial_partition_mode") or "?"
        params["memory_partition_mode"] = (read(f"{d}/memory_partition_mode") or "?").splitlines()[0]
    if mem is None and card.memory_mb:
        mem = card.memory_mb // max(numvfs, 1)  # an equal share: what the driver splits (AMD), or assumed
        params["size_from"] = "card memory / VFs"
    else:
        params["size_from"] = "driver quota"
    return mem, params


def _held_groups(host: Host) -> set[str]:
    """The IOMMU groups whose /dev/vfio node some process holds open (a VM using the VF)."""
    import os

    out: set[str] = set()
    proc = str(host.proc)
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            fds = os.listdir(f"{proc}/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{proc}/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/vfio/"):
                out.add(target[len("/dev/vfio/"):])
    return out


def discover_types(host: Host, parent: str | None = None) -> list[VgpuType]:
    from vgpumgr.model import VgpuType

    out: list[VgpuType] = []
    held_groups: set[str] | None = None
    base = str(host.pci_devices)
    for pf in listdir(base):
        if read_int(f"{base}/{pf}/sriov_totalvfs") is None:
            continue
        card = card_of(host, pf)
        if card is None:
            continue
        numvfs = read_int(f"{base}/{pf}/sriov_numvfs", 0) or 0
        tid, name = vendors.vf_slice_name(card, numvfs)
        for index, vf in enumerate(virtfns(f"{base}/{pf}", numvfs), start=1):
            if parent is not None and parent not in (vf, pf):
                continue
            mem, params = slice_facts(host, pf, card, index, numvfs)
            group = link_name(f"{base}/{vf}/iommu_group")
            if held_groups is None:
                held_groups = _held_groups(host)  # /proc read once per scan, only on a host with such cards
            held = group in held_groups
            desc = ", ".join(f"{k}={v}" for k, v in params.items() if k != "vendor")
            out.append(VgpuType(parent=vf, type=tid, name=name, description=f"memory={mem}M, {desc}" if mem else desc,
                                device_api="vfio-pci", available_instances=0 if held else 1, backend=BACKEND_VF,
                                params=params, gpu=pf, framebuffer_mb=mem, max_instance=numvfs))
    return out
