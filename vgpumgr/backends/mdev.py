"""Mediated devices: create on a parent's type, remove, with checks first and bounded waits."""

from __future__ import annotations

from vgpumgr import ids
from vgpumgr.backends.common import HolderCheck, ensure_free, vfio_holders, wait_for, write
from vgpumgr.discovery.fs import read
from vgpumgr.errors import Busy, Conflict, NoCapacity, NotFound, Timeout
from vgpumgr.hostfs.root import Host
from vgpumgr.model import Mdev


def find_type_dir(host: Host, parent: str, type_id: str) -> str:
    parent = ids.parent_name(parent)
    if not host.parent(parent).exists():
        raise NotFound(f"no mdev parent {parent}", hint="`vgpumgr types` lists the parents that offer vGPU types")
    d = host.mdev_type(parent, type_id)
    if not d.is_dir():
        raise NotFound(f"parent {parent} offers no type {type_id}",
                       hint=f"`vgpumgr types --parent {parent}` lists its types")
    return str(d)


def get(host: Host, uuid: str) -> Mdev | None:
    from vgpumgr.discovery.mdev import read_mdev

    return read_mdev(host, ids.mdev_uuid(uuid))


def create(host: Host, parent: str, type_id: str, uuid: str | None = None, timeout: float = 10.0) -> Mdev:
    """Create an mdev; idempotent for an existing device of the same parent and type."""
    parent = ids.parent_name(parent)
    type_id = ids.type_dir(type_id)
    uuid = ids.mdev_uuid(uuid) if uuid else ids.new_uuid()
    tdir = find_type_dir(host, parent, type_id)
    existing = get(host, uuid)
    if existing:
        if existing.parent == parent and existing.type == type_id:
            return existing
        raise Conflict(f"mdev {uuid} already exists as {existing.type} on {existing.parent}",
                       hint="UUIDs are unique across all parents: pick another UUID or remove that device first")
    avail = read(f"{tdir}/available_instances", "0") or "0"
    if not avail.isdigit() or int(avail) < 1:
        raise NoCapacity(f"no {type_id} instances left on {parent}",
                         hint="remove a vGPU there or choose another parent (`vgpumgr types` shows availability); "
                              "NVIDIA GPUs in equal-size mode only take types of the framebuffer size in use")
    write(host, host.mdev_type(parent, type_id) / "create", uuid, f"creating mdev {uuid} ({type_id} on {parent})")
    if not wait_for(lambda: host.mdev(uuid).exists(), timeout):
        raise Timeout(f"mdev {uuid} did not appear within {timeout:g} s", hint="check `dmesg` for the driver's message")
    dev = get(host, uuid)
    assert dev is not None
    return dev


def holders(host: Host, dev: Mdev, extra: HolderCheck | None = None) -> list[str]:
    found = vfio_holders(host, dev.iommu_group)
    if extra:
        found += [h for h in extra(dev.uuid) if h not in found]
    return found


def remove(host: Host, uuid: str, *, grace: float = 0.0, timeout: float = 10.0,
           holder_check: HolderCheck | None = None) -> bool:
    """Remove an mdev. Returns False when it was already gone.

    `grace`: for NVIDIA vGPUs, how long to let the vendor driver remove the device itself after its VM
    stopped (removing it first can leave the vGPU stuck until a host reboot)."""
    dev = get(host, uuid)
    if dev is None:
        return False
    ensure_free(f"mdev {dev.uuid}", holders(host, dev, holder_check), Busy)
    if grace > 0 and dev.type.startswith("nvidia-"):
        if wait_for(lambda: not host.mdev(dev.uuid).exists(), grace, 0.1):
            return True
    try:
        write(host, host.mdev(dev.uuid) / "remove", "1", f"removing mdev {dev.uuid}", timeout=timeout)
    except NotFound:
        return False  # removed meanwhile (by the driver or another process)
    if not wait_for(lambda: not host.mdev(dev.uuid).exists(), timeout):
        raise Timeout(f"mdev {dev.uuid} is still present {timeout:g} s after remove",
                      hint="a VM may still hold it; check `dmesg`")
    return True
