"""Where Intel's drivers keep each VF's memory quota (docs/sources.md §22): the i915 backports under the PF's DRM
card (`drm/cardN/iov/vfN/gt/lmem_quota`), xe from Linux 7.0 under `sriov_admin/vfN/profile/vram_quota`. The one
place these paths are built: the vendor steps write them, discovery reads the VFs' sizes from them."""

from __future__ import annotations

import os

from vgpumgr.discovery.fs import listdir, read_int
from vgpumgr.hostfs.root import Host
from vgpumgr.vendors.profiles import Profile


def _places(host: Host, pf: str, card: Profile) -> list[tuple[str, str]]:
    """(before the VF number, after it) of each place the card's driver may keep a VF's quota."""
    d = host.pci(pf)
    if card.family == "intel-xe":
        return [(f"{d}/sriov_admin/vf", "/profile/vram_quota")]
    if card.family == "intel-i915":
        return [(f"{d}/drm/{drm}/iov/vf", "/gt/lmem_quota") for drm in listdir(f"{d}/drm")]
    return []


def _first(places: list[tuple[str, str]], n: int) -> str | None:
    return next((path for head, tail in places if os.path.exists(path := f"{head}{n}{tail}")), None)


def quota_path(host: Host, pf: str, card: Profile, n: int) -> str | None:
    """The quota file of VF `n` (1-based); None where the driver keeps none (another family, no such VF)."""
    return _first(_places(host, pf, card), n)


def quota_paths(host: Host, pf: str, card: Profile) -> dict[int, str]:
    """{VF number: its quota file} for every VF the PF offers (sriov_totalvfs), enabled or not."""
    places = _places(host, pf, card)
    if not places:
        return {}
    total = read_int(f"{host.pci(pf)}/sriov_totalvfs", 0) or 0
    found = {n: _first(places, n) for n in range(1, total + 1)}
    return {n: path for n, path in found.items() if path is not None}
