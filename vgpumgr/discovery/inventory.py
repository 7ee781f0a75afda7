"""One snapshot of the host: GPUs, vGPU types, mdevs and VF vGPUs, read from the one sysfs root."""

from __future__ import annotations

from vgpumgr.discovery import mdev as mdev_disc
from vgpumgr.discovery import nvidia_vf
from vgpumgr.hostfs.root import Host

TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing (~7 ms): see cli/main.py
if TYPE_CHECKING:
    from vgpumgr.model import Inventory, VgpuType


def discover_types(host: Host, parent: str | None = None, cache_path: str | None = None,
                   cache: mdev_disc.TypeCache | None = None) -> list[VgpuType]:
    from vgpumgr.discovery import vendor_vf

    cache = cache or mdev_disc.TypeCache(cache_path)
    return (mdev_disc.discover_types(host, parent, cache) + nvidia_vf.discover_types(host, parent)
            + vendor_vf.discover_types(host, parent))


def types_json(host: Host, parent: str | None = None, cache_path: str | None = None,
               available_only: bool = False) -> list[str]:
    """Encoded JSON objects of every type (mdev fast path + the few vendor-VF ones), as `types --json` prints."""
    import json

    from vgpumgr.discovery import vendor_vf

    cache = mdev_disc.TypeCache(cache_path)
    vf = [t for t in nvidia_vf.discover_types(host, parent) + vendor_vf.discover_types(host, parent)
          if t.available_instances or not available_only]
    return mdev_disc.types_json(host, parent, cache, available_only) + [json.dumps(t.to_json()) for t in vf]


def scan(host: Host, known_type_names: dict[int, str] | None = None) -> Inventory:
    from vgpumgr.discovery.pci import discover_gpus
    from vgpumgr.model import Inventory

    types = discover_types(host)
    names = dict(known_type_names or {})
    for t in types:
        if t.type.startswith("nvidia-"):
            names.setdefault(int(t.type[7:]), t.name)
    return Inventory(
        gpus=discover_gpus(host),
        types=types,
        mdevs=mdev_disc.discover_mdevs(host),
        vf_vgpus=nvidia_vf.discover_vf_vgpus(host, names),
    )
