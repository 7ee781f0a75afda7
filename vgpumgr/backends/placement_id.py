"""Giving a vGPU its placement ID in mixed-size mode, by the driver branch's interface (docs/sources.md §21).

R570+: the vGPU's `nvidia/placement_id` (an mdev's directory or the VF's), written after the vGPU is made
(the driver reserved its first creatable ID meanwhile) and read back. R550: no such file; the plugin parameter
`vgpu-placement-id=<id>` in `nvidia/vgpu_params`, validated by the driver when the VM starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from vgpumgr import ids
from vgpumgr.backends.common import write
from vgpumgr.discovery.fs import read
from vgpumgr.discovery.placement_id import placement_id as read_placement
from vgpumgr.errors import InvalidInput
from vgpumgr.hostfs.root import Host

PARAM = "vgpu-placement-id"


@dataclass(frozen=True)
class Applied:
    placement_id: int | None  # what the driver holds now (None: known only once the VM starts, R550)
    interface: str  # "placement_id" (R570+) or "vgpu_params" (R550)


def device_dir(host: Host, *, uuid: str | None = None, vf: str | None = None) -> str:
    if uuid:
        return os.fspath(host.mdev_devices / ids.mdev_uuid(uuid))
    if vf:
        return os.fspath(host.pci(vf))
    raise InvalidInput("a placement ID needs an mdev UUID or a VF address")


def apply(host: Host, directory: str, wanted: int) -> Applied:
    """Set the placement ID of the vGPU at `directory`; raises the kernel's error when it refuses."""
    path = f"{directory}/nvidia/placement_id"
    if os.path.exists(path):
        if read_placement(directory) != wanted:
            write(host, Path(path), f"{wanted}\n", f"setting placement ID {wanted}",
                  hint="the ID must be creatable for the type now; `vgpumgr types --json` lists them")
        return Applied(read_placement(directory), "placement_id")
    params = f"{directory}/nvidia/vgpu_params"
    current = (read(params, "") or "").strip()
    items = [p.strip() for p in current.split(",") if p.strip() and p.split("=")[0].strip() != PARAM]
    write(host, Path(params), ",".join([*items, f"{PARAM}={wanted}"]) + "\n", f"asking for placement ID {wanted}")
    return Applied(None, "vgpu_params")


def current(directory: str) -> int | None:
    """The placement the driver holds (R570+), else the one vgpu_params asks for (R550), else None."""
    got = read_placement(directory)
    if got is not None:
        return got
    text = read(f"{directory}/nvidia/vgpu_params", "") or ""
    for item in text.replace("\n", ",").split(","):
        name, _, value = item.partition("=")
        if name.strip() == PARAM and value.strip().isdigit():
            return int(value.strip())
    return None
