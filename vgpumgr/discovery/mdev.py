"""mdev parents (/sys/class/mdev_bus), their types, and active mdevs (/sys/bus/mdev/devices)."""

from __future__ import annotations

import json
import os
import re

from vgpumgr import ids
from vgpumgr.discovery.fs import link_name, listdir, read
from vgpumgr.discovery.placement_id import placement_id as read_placement_id
from vgpumgr.hostfs.root import Host
from vgpumgr.kinds import BACKEND_MDEV

TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing (~7 ms): see cli/main.py
if TYPE_CHECKING:
    from vgpumgr.model import Mdev, VgpuType

_NVIDIA_DESC = r"(\w+)=([^,]+)"  # compiled on first use (re caches it)
_KV_LINES = r"(?m)^\s*([\w ]+?)\s*:\s*(.+?)\s*$"


def parse_description(text: str) -> dict[str, str]:
    """NVIDIA: `num_heads=4, frl_config=60, framebuffer=4096M, ...`; Intel GVT-g: `low_gm_size: 128MB` lines."""
    if not text:
        return {}
    if "=" in text:
        return {k: v.strip() for k, v in re.findall(_NVIDIA_DESC, text)}
    if ":" in text:
        return dict(re.findall(_KV_LINES, text))
    return {}


def enrich(t: VgpuType) -> VgpuType:
    """Framebuffer, max_instance, series and MIG slices from the description and the type name."""
    fb = t.params.get("framebuffer")
    if fb and fb.endswith("M") and fb[:-1].isdigit():
        t.framebuffer_mb = int(fb[:-1])
    mi = t.params.get("max_instance")
    if mi and mi.isdigit():
        t.max_instance = int(mi)
    if not t.type.startswith("nvidia-"):
        _vendor_sizes(t)
    parsed = ids.parse_type_name(t.name) if t.type.startswith("nvidia-") else None
    if parsed:
        t.series = parsed.series
        t.mig_slices = parsed.mig_slices
        if t.framebuffer_mb is None:
            t.framebuffer_mb = int(parsed.framebuffer_gb * 1024)
    return t


def _vendor_sizes(t: VgpuType) -> None:
    """Sizes of vendor mdev types (Ascend vNPU, Moore Threads; vgpumgr/vendors/profiles.py), into framebuffer_mb and
    params; the name, where the driver gives none, from the card's profile."""
    from vgpumgr.vendors import profiles as vendors

    facts = vendors.mdev_type_facts(t.type, t.description.replace(", ", "\n"))
    if facts is None:
        return
    t.framebuffer_mb = facts.memory_mb
    t.params.update(facts.extra)
    if not t.name:
        t.name = f"{t.type.split('-')[0].replace('vnpu', 'Ascend vNPU').replace('mtgpu', 'MTT vGPU')} {t.type}"


def parents(host: Host) -> list[str]:
    return listdir(str(host.mdev_bus))


def physical_gpu(host: Host, parent: str) -> str | None:
    """The PF address behind an mdev parent; None for virtual parents (mtty)."""
    if not ids.is_pci_address(parent):
        return None
    return link_name(f"{host.mdev_bus}/{parent}/physfn") or parent


CACHE_VERSION = 4


class TypeCache:
    """Static facts of mdev types (name, description, device_api) keyed by the identity of each parent's
    `mdev_supported_types` directory, so a repeated scan re-reads only `available_instances`.

    A driver reload re-creates the directory (new inode), which invalidates the entry."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.data: dict[str, dict] = {}
        self.dirty = False
        if path:
            try:
                with open(path) as f:
                    self.data = json.load(f)
            except (OSError, ValueError):
                self.data = {}

    def get(self, parent: str, key: list[int]) -> dict[str, list] | None:
        entry = self.data.get("parents", {}).get(parent)
        if not entry or entry.get("key") != key or self.data.get("v") != CACHE_VERSION:
            return None
        return self.data["sets"].get(entry["set"])

    def put(self, parent: str, key: list[int], types: dict[str, list]) -> None:
        """Parents of one GPU model offer identical types: each distinct set is stored once."""
        import hashlib

        if self.data.get("v") != CACHE_VERSION:
            self.data = {"v": CACHE_VERSION, "parents": {}, "sets": {}}
        sig = hashlib.sha1(json.dumps(types, sort_keys=True).encode()).hexdigest()
        self.data["sets"].setdefault(sig, types)
        self.data["parents"][parent] = {"key": key, "set": sig}
        self.dirty = True

    def save(self) -> None:
        if not (self.path and self.dirty):
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only state dir only costs speed


STATIC_FIELDS = ("name", "description", "device_api", "backend", "framebuffer_mb", "max_instance", "series",
                 "mig_slices")


def _static_types(host: Host, p: str, base: str, cache: TypeCache) -> dict[str, list] | None:
    """Per type dir: [name, description, device_api, params, framebuffer_mb, max_instance, series, mig_slices,
    the same fields pre-encoded as a JSON fragment]; read once per parent and cached."""
    try:
        st = os.stat(base)
    except OSError:
        return None
    key = [st.st_ino, st.st_ctime_ns]
    static = cache.get(p, key)
    if static is None:
        from vgpumgr.model import VgpuType

        static = {}
        for tdir in listdir(base):
            d = f"{base}/{tdir}"
            name, desc = read(f"{d}/name", "") or "", read(f"{d}/description", "") or ""
            t = enrich(VgpuType(parent=p, type=tdir, name=name, description=desc.replace("\n", ", "),
                                device_api=read(f"{d}/device_api", "") or "", available_instances=0,
                                backend=BACKEND_MDEV, params=parse_description(desc)))
            fragment = json.dumps({k: getattr(t, k) for k in STATIC_FIELDS})[1:-1]
            static[tdir] = [t.name, t.description, t.device_api, t.params, t.framebuffer_mb, t.max_instance,
                            t.series, t.mig_slices, fragment]
        cache.put(p, key, static)
    return static


def _parent_types(host: Host, parent: str | None, cache: TypeCache):  # noqa: ANN202
    """(parent, its GPU, type dir, cached static entry, available_instances) for every type of every parent."""
    for p in [ids.parent_name(parent)] if parent else parents(host):
        base = f"{host.mdev_bus}/{p}/mdev_supported_types"
        static = _static_types(host, p, base, cache)
        if static is None:
            continue
        gpu = physical_gpu(host, p)
        for tdir, entry in static.items():
            avail = read(f"{base}/{tdir}/available_instances", "0") or "0"
            yield p, gpu, tdir, entry, int(avail) if avail.isdigit() else 0


def discover_types(host: Host, parent: str | None = None, cache: TypeCache | None = None) -> list[VgpuType]:
    from vgpumgr.model import VgpuType

    cache = cache or TypeCache(None)
    out = [VgpuType(parent=p, type=tdir, name=name, description=desc, device_api=api, available_instances=n,
                    backend=BACKEND_MDEV, params=dict(params), gpu=gpu, framebuffer_mb=fb, max_instance=maxi,
                    series=series, mig_slices=slices)
           for p, gpu, tdir, (name, desc, api, params, fb, maxi, series, slices, _), n
           in _parent_types(host, parent, cache)]
    cache.save()
    return out


def types_json(host: Host, parent: str | None = None, cache: TypeCache | None = None,
               available_only: bool = False) -> list[str]:
    """`VgpuType.to_json()` of every mdev type, already encoded: the fast path of `vgpumgr types --json`
    (a host with 128 parents has thousands of types; only `available_instances` is read per call)."""
    cache = cache or TypeCache(None)
    heads: dict[str, str] = {}
    out = []
    for p, gpu, tdir, entry, n in _parent_types(host, parent, cache):
        if n or not available_only:
            head = heads.get(p) or heads.setdefault(p, f'{{"parent": {json.dumps(p)}, "gpu": {json.dumps(gpu)}, '
                                                       '"type": ')
            out.append(f'{head}{json.dumps(tdir)}, "available_instances": {n}, {entry[8]}}}')
    cache.save()
    return out


def discover_mdevs(host: Host, parents: set[str] | None = None) -> list[Mdev]:
    """The mdevs of the host, or only those under `parents` (what a re-read after our own change needs)."""
    if parents is None:
        candidates = listdir(str(host.mdev_devices))
    else:  # an mdev's device directory is a child of its parent's (as in the kernel): list only those parents
        candidates = sorted(_children(str(host.mdev_bus), parents))
    out = []
    for uuid in candidates:
        m = read_mdev(host, uuid, parents)
        if m is not None:
            out.append(m)
    return out


def _children(bus: str, parents: set[str]) -> set[str]:
    found: set[str] = set()
    for p in parents:
        try:
            names = os.listdir(f"{bus}/{ids.parent_name(p)}")
        except OSError:  # not an mdev parent (e.g. the PF of a VF parent), or gone
            continue
        found.update(n for n in names if ids.is_mdev_uuid(n))
    return found


def read_mdev(host: Host, uuid: str, parents: set[str] | None = None) -> Mdev | None:
    """One mdev from its bus link (None when it is gone, or under none of `parents`); `uuid` is validated."""
    from vgpumgr.model import Mdev

    link = f"{host.mdev_devices}/{uuid}"
    try:  # sysfs links to .../<parent>/<uuid>: the parent is the link's second-last name, no realpath needed
        target = os.readlink(link)
    except OSError:
        return None
    if os.path.basename(target) != uuid:
        target = os.path.realpath(link)
    parent = os.path.basename(os.path.dirname(target))
    if parents is not None and parent not in parents:
        return None
    group = link_name(f"{link}/iommu_group")
    type_dir = link_name(f"{link}/mdev_type") or "?"
    backing = read(f"{link}/hw_vdavinci/vf") if type_dir.startswith("vnpu-") else None
    return Mdev(uuid=uuid, parent=parent, type=type_dir, iommu_group=int(group) if group and group.isdigit() else None,
                gpu=physical_gpu(host, parent), placement_id=read_placement_id(link), backing_vf=backing or None)
