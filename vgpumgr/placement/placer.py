"""Choosing where a new vGPU goes.

`place(inv, allocations, request, policy)` is a pure function of a host snapshot, the allocations
vgpumgr knows about, the request and the policy. It returns the chosen parent and, for every other
candidate, why it was not chosen. Nothing here reads sysfs or keeps state between calls.

Capacity is computed on the physical GPU from NVIDIA's rules (equal-size or mixed-size mode,
`max_instance` per framebuffer size, one vGPU per VF, free MIG GPU instances), because on SR-IOV
GPUs a VF's `available_instances` is only ever 0 or 1. The driver's own listing ("creatable now")
is then used as a veto: vgpumgr never picks a parent the driver says cannot take the type.
Non-NVIDIA parents (Intel GVT-g, mtty) follow `available_instances`.

A `Placer` holds the per-inventory index; the service should keep one per inventory snapshot and
call `Placer.place` for each allocation. `place()` builds a fresh one per call.

Long because: NVIDIA's capacity rules (equal/mixed size, max_instance, VF and MIG limits) and the
reasons for every refusal read as one argument; the index, the rules and the explanation share private
types, and splitting them across files would make each rule harder to follow, not easier.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from vgpumgr import ids
from vgpumgr.errors import InvalidInput, NotFound
from vgpumgr.mig.facts import MigFacts, users_text
from vgpumgr.mig.plan import profile_for_type
from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF, BACKEND_VF, Inventory, VgpuType
from vgpumgr.placement import ids as pid
from vgpumgr.placement.mixed import is_mixed, mixed_choice
from vgpumgr.vendors import profiles as vendors

STRATEGIES = ("pack", "spread")
# time-sliced vGPUs per physical GPU are capped at 32 by the driver (docs/sources.md §5)
_MAX_TIMESLICED_PER_GPU = 32


# -- inputs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Allocation:
    """One vGPU that exists on the host or is reserved for creation.

    `id` is the mdev UUID (mdev backend) or the VF address (nvidia-vf); with `parent` it is the
    identity used to merge reserved records with what the host already has."""

    gpu: str | None  # physical GPU (PF) address; None for virtual parents such as mtty
    parent: str  # mdev parent (PF, VF, virtual) or the VF for nvidia-vf
    type: str  # type id: nvidia-232, mtty-1, i915-GVTg_V5_4
    framebuffer_mb: int | None
    vm: str | None
    backend: str
    id: str
    name: str | None = None  # type name when known: GRID T4-4Q
    placement_id: int | None = None  # mixed-size mode: its placement ID (GB offset), when known

    @cached_property
    def parsed(self) -> ids.TypeName | None:
        """The type name in NVIDIA's grammar, parsed once for this record."""
        return ids.parse_type_name(self.name) if self.name else None

    @property
    def key(self) -> tuple[str, str]:
        return (self.parent, self.id)


def requested_type(value: str | None) -> str:
    """A vGPU type as a request names it (this host's placement, the fleet's), checked and stripped."""
    wanted = (value or "").strip()
    if not wanted or len(wanted) > 128:
        raise InvalidInput(f"'{value}' is not a vGPU type",
                           hint="name a type by its short name (T4-4Q), full name (GRID T4-4Q) or id (nvidia-232)")
    return wanted


@dataclass(frozen=True)
class Request:
    """One vGPU: `type` is an id (nvidia-232), a full name (GRID T4-4Q) or a short name (T4-4Q)."""

    type: str
    vm: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", requested_type(self.type))
        if self.vm is not None:
            object.__setattr__(self, "vm", ids.vm_name(self.vm))


@dataclass(frozen=True)
class Policy:
    """How to choose among parents that can take the vGPU.

    `numa` is a preference, not a filter. `mixed_size_gpus` names the physical GPUs whose driver
    is in mixed-size (heterogeneous) mode; every other NVIDIA GPU is treated as equal-size."""

    strategy: str = "pack"
    numa: int | None = None
    pin_gpu: str | None = None
    pin_parent: str | None = None
    allow_models: tuple[str, ...] = ()
    deny_models: tuple[str, ...] = ()
    deny_gpus: frozenset[str] = frozenset()
    mixed_size_gpus: frozenset[str] = frozenset()
    placement_id: int | None = None  # mixed-size mode: pin the vGPU's placement ID (GB offset)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise InvalidInput(f"unknown placement strategy '{self.strategy}'",
                               hint="use pack (fill one GPU before the next) or spread (least loaded first)")
        if self.numa is not None and (not isinstance(self.numa, int) or self.numa < 0):
            raise InvalidInput(f"'{self.numa}' is not a NUMA node", hint="give a node number such as 0 or 1")
        if self.placement_id is not None and (isinstance(self.placement_id, bool) or not isinstance(
                self.placement_id, int) or not 0 <= self.placement_id < 256):
            raise InvalidInput(f"'{self.placement_id}' is not a placement ID",
                               hint="give a GB offset such as 0 or 24; `vgpumgr types --json` lists each type's IDs")
        setter = object.__setattr__
        if self.pin_gpu is not None:
            setter(self, "pin_gpu", ids.pci_address(self.pin_gpu))
        if self.pin_parent is not None:
            setter(self, "pin_parent", ids.parent_name(self.pin_parent))
        setter(self, "allow_models", tuple(_models(self.allow_models)))
        setter(self, "deny_models", tuple(_models(self.deny_models)))
        setter(self, "deny_gpus", frozenset(ids.pci_address(g) for g in _iter(self.deny_gpus)))
        setter(self, "mixed_size_gpus", frozenset(ids.pci_address(g) for g in _iter(self.mixed_size_gpus)))


def _iter(value: Iterable[str] | str | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


def _models(value: Iterable[str] | str | None) -> list[str]:
    out = [m.strip() for m in _iter(value) if m and m.strip()]
    for m in out:
        if len(m) > 64:
            raise InvalidInput(f"model name '{m[:64]}…' is too long", hint="use a model such as T4 or A40")
    return out


# -- outputs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    gpu: str | None  # physical GPU; None for virtual parents
    parent: str  # where to create: PF/virtual parent (mdev), or the chosen VF
    type: str  # type id to create: nvidia-232
    name: str  # GRID T4-4Q
    backend: str
    numa_node: int | None
    load: float  # share of the GPU (or parent) in use before this vGPU, 0..1
    free_vfs: int | None  # SR-IOV GPUs: free VFs before this vGPU
    why: str  # what made it rank where it did
    placement_id: int | None = None  # mixed-size mode: the placement ID to give the vGPU


@dataclass(frozen=True)
class Rejection:
    gpu: str | None
    parent: str | None  # None: the GPU as a whole (every VF of an SR-IOV GPU)
    type: str
    name: str
    reason: str
    fits: bool = False  # True: it could take the vGPU but ranked below the choice


@dataclass(frozen=True)
class Decision:
    choice: Candidate | None
    rejected: list[Rejection]
    considered: int
    request: Request | None = None
    policy: Policy | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "choice": asdict(self.choice) if self.choice else None,
            "rejected": [asdict(r) for r in self.rejected],
            "considered": self.considered,
            "request": asdict(self.request) if self.request else None,
            "policy": _policy_dict(self.policy) if self.policy else None,
        }

    def summary(self) -> str:
        """One line for a NoCapacity message: why each candidate was refused."""
        parts = [f"{r.parent or r.gpu}: {r.reason}" for r in self.rejected if not r.fits]
        return "; ".join(parts) if parts else "no candidate parent"


def _policy_dict(p: Policy) -> dict[str, Any]:
    d = asdict(p)
    d["deny_gpus"] = sorted(p.deny_gpus)
    d["mixed_size_gpus"] = sorted(p.mixed_size_gpus)
    d["allow_models"] = list(p.allow_models)
    d["deny_models"] = list(p.deny_models)
    return d


# -- type facts -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TypeInfo:
    type: str
    name: str
    short: str
    backend: str
    framebuffer_mb: int | None  # None: not an NVIDIA type, follow available_instances
    max_instance: int | None
    mig_profile: str | None  # GPU-instance profile a MIG-backed type needs: 1g.10gb, 1g.10gb+me
    max_per_vm: int | None  # None: unlimited
    parsed: ids.TypeName | None = None  # NVIDIA's type grammar, parsed once with the type's other facts

    @property
    def nvidia(self) -> bool:
        return self.framebuffer_mb is not None

    def matches(self, wanted: str) -> bool:
        return wanted in (self.type, self.name, self.short) or wanted.lower() == self.name.lower()


def mig_profile_for(name: str) -> str | None:
    """`NVIDIA H100XM-1-10CME` -> `1g.10gb+me`; None for time-sliced and non-NVIDIA names."""
    return profile_for_type(name)


# Nominal framebuffer (GB) by the GPU token of type names (docs/sources.md §5), for vendor-VF GPUs whose
# "creatable now" listing carries no max_instance and no NVML data is at hand.
_NOMINAL_GB = {"T4": 16, "A2": 16, "A16": 16, "A10": 24, "L4": 24, "A30": 24, "A40": 48, "L40": 48, "L40S": 48,
               "RTX6000-Ada": 48, "A100": 40, "A100X": 40, "A100D": 80, "A100DX": 80, "H100": 80, "H100XM": 80,
               "H100L": 94, "H200X": 141}


def _info_from_type(t: VgpuType) -> _TypeInfo:
    # NVIDIA's capacity rules work on framebuffer sizes; other vendors' sizes are for listings only, and their
    # parents follow available_instances (mdev) or their free VFs (vendor SR-IOV)
    fb = t.framebuffer_mb if t.type.startswith("nvidia-") or t.backend == BACKEND_NVIDIA_VF else None
    parsed = ids.parse_type_name(t.name) if t.name else None
    if fb is None and t.backend == BACKEND_NVIDIA_VF and parsed:
        fb = int(parsed.framebuffer_gb * 1024)
    mig = parsed.mig_profile if fb is not None and parsed else None
    per_vm = t.params.get("max_instances_per_vm") if t.params else None
    max_per_vm = int(per_vm) if per_vm and str(per_vm).isdigit() else (1 if fb is not None else None)
    return _TypeInfo(t.type, t.name or t.type, t.short_name, t.backend, fb, t.max_instance, mig, max_per_vm, parsed)


_INFO_MEMO: dict[tuple[Any, ...], _TypeInfo] = {}


def _cached_info(t: VgpuType) -> _TypeInfo:
    """`_info_from_type` of a type's static facts, remembered (a placer is rebuilt after every change)."""
    per_vm = t.params.get("max_instances_per_vm") if t.params else None
    key = (t.type, t.name, t.backend, t.framebuffer_mb, t.max_instance, per_vm)
    info = _INFO_MEMO.get(key)
    if info is None:
        if len(_INFO_MEMO) > 4096:  # bounded: a host has at most a few thousand distinct types
            _INFO_MEMO.clear()
        info = _INFO_MEMO[key] = _info_from_type(t)
    return info


def _info_from_allocation(a: Allocation) -> _TypeInfo:
    name = a.name or a.type
    nvidia = a.type.startswith("nvidia-") or a.backend == BACKEND_NVIDIA_VF
    fb = a.framebuffer_mb if nvidia else None
    parsed = a.parsed if nvidia else None
    if fb is None and parsed is not None:
        fb = int(parsed.framebuffer_gb * 1024)
    short = name.split()[-1] if name else a.type
    return _TypeInfo(a.type, name, short, a.backend, fb, None, parsed.mig_profile if fb and parsed else None,
                     1 if fb is not None else None, parsed)


# -- mixed-size placement IDs (docs/sources.md §5, simplified, pre-Blackwell) ----------------------


def mixed_size_placements(region_gb: int, size_gb: int, max_instance: int) -> tuple[int, ...]:
    """Placement IDs (GB offsets) a type may use in mixed-size mode (vgpumgr.placement.ids.supported)."""
    from vgpumgr.placement.ids import supported

    return supported(region_gb, size_gb, max_instance)


# -- the per-inventory index ----------------------------------------------------------------------


_Model = tuple[str, str]


class Placer:
    """Index of one inventory snapshot. Cheap to query; build once per snapshot."""

    def __init__(self, inv: Inventory) -> None:
        self.inv = inv
        self.gpus = {g.address: g for g in inv.gpus}
        vfs: dict[str, set[str]] = {}
        for g in inv.gpus:
            if g.physfn:
                vfs.setdefault(g.physfn, set()).add(g.address)
            elif g.sriov and g.sriov.vfs:
                vfs.setdefault(g.address, set()).update(g.sriov.vfs)
        self.vfs_of = {pf: sorted(v) for pf, v in vfs.items()}
        # physical GPUs and virtual parents of each model that can host vGPUs
        self._members: dict[_Model, set[str]] = {}
        for g in inv.gpus:
            vgpu_capable = g.address in self.vfs_of or {BACKEND_MDEV, BACKEND_NVIDIA_VF} & set(g.backends)
            if g.physfn is None and vgpu_capable:
                self._members.setdefault((g.vendor_id, g.device_id), set()).add(g.address)
        # (physical gpu or virtual parent, type id) -> listings on its parents
        self.listings: dict[tuple[str, str], list[VgpuType]] = {}
        self.catalogue: dict[_Model, dict[str, _TypeInfo]] = {}
        self._model_of: dict[str, _Model] = {}
        self._region_exact: dict[_Model, int] = {}  # max framebuffer x max_instance over known types
        self._region_floor: dict[_Model, int] = {}  # largest framebuffer seen
        for g in inv.gpus:
            if g.physfn is None and g.nvml:
                self._add_nvml_types(g.address, g.nvml)
        # (rebuilt after each change of ours: a parent's types come together, so its GPU's model and
        # catalogue are looked up once per run of types, and a type's facts once per process)
        last_phys: str | None = None
        model: _Model = ("", "")
        cat: dict[str, _TypeInfo] = {}
        for t in inv.types:
            phys = t.gpu or self.physical(t.parent)
            key = (phys, t.type)
            lst = self.listings.get(key)
            if lst is not None:
                lst.append(t)
                continue
            self.listings[key] = [t]
            if phys != last_phys:
                last_phys, model = phys, self.model_of(phys)
                self._members.setdefault(model, set()).add(phys)
                cat = self.catalogue.setdefault(model, {})
            if t.type not in cat:
                self._add_info(model, _cached_info(t))
        self._region_memo: dict[tuple[_Model, str], int | None] = {}
        self._mig_memo: dict[str, MigFacts | None] = {}

    # -- lookups
    def physical(self, parent: str) -> str:
        g = self.gpus.get(parent)
        return g.physical if g else parent

    def model_of(self, phys: str) -> _Model:
        m = self._model_of.get(phys)
        if m is None:
            g = self.gpus.get(phys)
            m = (g.vendor_id, g.device_id) if g else ("virtual", phys)
            self._model_of[phys] = m
        return m

    def members(self, model: _Model) -> list[str]:
        return sorted(self._members.get(model, ()))

    def region_mb(self, phys: str, type_name: str = "") -> int | None:
        """The physical GPU's nominal framebuffer: from NVML or mdev descriptions (framebuffer x
        max_instance), else the nominal size of the model (named by a listed type or `type_name`),
        else the largest type seen."""
        model = self.model_of(phys)
        exact = self._region_exact.get(model)
        if exact:
            return exact
        key = (model, type_name)
        if key not in self._region_memo:
            self._region_memo[key] = self._region_floor.get(model)
            named = [ids.parse_type_name(type_name), *(i.parsed for i in self.catalogue.get(model, {}).values())]
            for parsed in named:
                if parsed and parsed.gpu in _NOMINAL_GB:
                    self._region_memo[key] = _NOMINAL_GB[parsed.gpu] * 1024
                    break
        return self._region_memo[key]

    def _add_info(self, model: _Model, info: _TypeInfo) -> None:
        self.catalogue.setdefault(model, {})[info.type] = info
        if info.framebuffer_mb and info.mig_profile is None:
            if info.max_instance:
                cap = info.framebuffer_mb * info.max_instance
                self._region_exact[model] = max(cap, self._region_exact.get(model, 0))
            self._region_floor[model] = max(info.framebuffer_mb, self._region_floor.get(model, 0))

    def _add_nvml_types(self, phys: str, nvml: Mapping[str, Any]) -> None:
        """NVML's supported types (the static catalogue) when discovery attached them to the GPU:
        gpu.nvml["vgpu"]["supported_types"] = [{"type", "name", "framebuffer_mb", "max_instances"}]."""
        vgpu = nvml.get("vgpu") if isinstance(nvml, Mapping) else None
        supported = vgpu.get("supported_types") if isinstance(vgpu, Mapping) else None
        backend = BACKEND_NVIDIA_VF if any(
            BACKEND_NVIDIA_VF in self.gpus[v].backends for v in self.vfs_of.get(phys, ()) if v in self.gpus
        ) else BACKEND_MDEV
        model = self.model_of(phys)
        for d in supported or []:
            if not isinstance(d, Mapping) or not d.get("type") or not d.get("name"):
                continue
            name = str(d["name"])
            maxi = d.get("max_instances") if isinstance(d.get("max_instances"), int) else None
            fb = d.get("framebuffer_mb") if isinstance(d.get("framebuffer_mb"), int) else None
            t = VgpuType(phys, str(d["type"]), name, "", "vfio-pci", 0, backend, gpu=phys,
                         framebuffer_mb=fb, max_instance=maxi)
            if t.type not in self.catalogue.get(model, {}):
                self._add_info(model, _info_from_type(t))

    def mig_facts(self, phys: str) -> MigFacts | None:
        """What NVML said of the GPU's MIG mode and instances (None: nothing)."""
        if phys not in self._mig_memo:
            g = self.gpus.get(phys)
            self._mig_memo[phys] = MigFacts.of(g.nvml) if g is not None else None
        return self._mig_memo[phys]

    def mixed(self, g: _Group, policy: Policy) -> bool:
        """Is this GPU in mixed-size mode (NVML says so, or the policy names it)?"""
        if g.phys in policy.mixed_size_gpus:
            return g.sriov
        return is_mixed(self.gpus.get(g.phys))

    def info(self, phys: str | None, type_id: str) -> _TypeInfo | None:
        if phys is None:
            return None
        return self.catalogue.get(self.model_of(phys), {}).get(type_id)

    # -- allocations
    def allocations_from_inventory(self) -> list[Allocation]:
        out: list[Allocation] = []
        for m in self.inv.mdevs:
            phys = m.gpu or self.physical(m.parent)
            info = self.info(phys, m.type)
            gpu = phys if phys in self.gpus else None
            out.append(Allocation(gpu, m.parent, m.type, info.framebuffer_mb if info else None, None,
                                  BACKEND_MDEV, m.uuid, info.name if info else None, m.placement_id))
        for v in self.inv.vf_vgpus:
            info = self.info(v.gpu, v.type)
            name = v.name or (info.name if info else None)
            fb = info.framebuffer_mb if info else None
            if fb is None and name:
                parsed = info.parsed if info and info.name == name else ids.parse_type_name(name)
                fb = int(parsed.framebuffer_gb * 1024) if parsed else None
            out.append(Allocation(v.gpu, v.address, v.type, fb, None, BACKEND_NVIDIA_VF, v.address, name,
                                  v.placement_id))
        return out

    def merged_allocations(self, records: Sequence[Allocation]
                           ) -> tuple[list[Allocation], set[tuple[str, str]]]:
        """Host allocations plus reserved records; a record for an existing device replaces it
        (it knows the VM). Returns the list and the keys of records not yet on the host."""
        existing = {a.key: a for a in self.allocations_from_inventory()}
        pending: set[tuple[str, str]] = set()
        for r in records:
            if r.key not in existing:
                pending.add(r.key)
            prior = existing.get(r.key)
            existing[r.key] = r if prior is None else _merge(prior, r)
        return list(existing.values()), pending

    # -- placement
    def place(self, allocations: Sequence[Allocation], request: Request, policy: Policy | None = None,
              *, free_gpu_instances: Mapping[str, Sequence[str]] | None = None) -> Decision:
        return _place(self, allocations, request, policy or Policy(), free_gpu_instances or {})


def _merge(existing: Allocation, record: Allocation) -> Allocation:
    fb = existing.framebuffer_mb if existing.framebuffer_mb is not None else record.framebuffer_mb
    vm = record.vm if record.vm is not None else existing.vm
    place = existing.placement_id if existing.placement_id is not None else record.placement_id
    return Allocation(existing.gpu or record.gpu, existing.parent, existing.type, fb, vm, existing.backend,
                      existing.id, existing.name or record.name, place)


def allocations_from_inventory(inv: Inventory) -> list[Allocation]:
    """The vGPUs that exist on the host (mdevs and VF vGPUs), without VM names."""
    return Placer(inv).allocations_from_inventory()


def place(inv: Inventory, allocations: Sequence[Allocation], request: Request, policy: Policy | None = None,
          *, free_gpu_instances: Mapping[str, Sequence[str]] | None = None) -> Decision:
    """Choose where `request` goes. `allocations` are the records vgpumgr holds (reserved or
    created); what exists on the host is read from `inv` and merged by (parent, id).
    `free_gpu_instances` maps a physical GPU to its free MIG GPU-instance profiles; a GPU listed
    there is in MIG mode. Raises NotFound when no parent knows the type; returns a Decision with
    `choice=None` when the type exists but nothing can take it."""
    return Placer(inv).place(allocations, request, policy, free_gpu_instances=free_gpu_instances)


# -- evaluation -----------------------------------------------------------------------------------


@dataclass
class _Group:
    """One place a vGPU could go: a (physical GPU, type) pair, or (parent, type) for non-NVIDIA."""

    phys: str  # physical GPU, or the virtual parent
    info: _TypeInfo
    listed: list[VgpuType]  # the driver's listings of this type on the group's parents
    sriov: bool


@dataclass
class _GpuLoad:
    allocations: list[Allocation] = field(default_factory=list)
    pending: list[Allocation] = field(default_factory=list)


def _place(px: Placer, records: Sequence[Allocation], request: Request, policy: Policy,
           free_gis: Mapping[str, Sequence[str]]) -> Decision:
    wanted = request.type
    allocations, pending_keys = px.merged_allocations(records)
    loads: dict[str, _GpuLoad] = {}
    for a in allocations:
        load = loads.setdefault(a.gpu or px.physical(a.parent), _GpuLoad())
        load.allocations.append(a)
        if a.key in pending_keys:
            load.pending.append(a)

    groups = _groups(px, allocations, wanted)
    if not groups:
        whole = vendors.passthrough_refusal(wanted, [(g.address, g.vendor_id, g.device_id) for g in px.inv.gpus
                                                     if g.physfn is None])
        if whole:
            raise InvalidInput(f"'{wanted}' cannot be a slice on this host: {whole}",
                               hint="a passthrough-only card has no vGPU types")
        off = _vfs_off(px, wanted)
        if off:
            listed = ", ".join(f"{g.name} at {g.address}" for g in off)
            raise NotFound(f"no parent on this host offers vGPU type '{wanted}': the SR-IOV VFs of {listed} are "
                           "off (a reboot or driver reload disables them), and its vGPU types exist only on VFs",
                           hint="run `vgpumgr restore` (it enables the VFs vgpumgr recorded) or "
                                + "; ".join(f"`/usr/lib/nvidia/sriov-manage -e {g.address}`" for g in off))
        hint = vendors.no_vfs_hint(wanted, [(g.address, g.vendor_id, g.device_id, g.sriov.numvfs) for g in px.inv.gpus
                                            if g.sriov is not None]) or _close_names(px, wanted)
        raise NotFound(f"no parent on this host offers vGPU type '{wanted}'", hint=hint)

    fits: list[tuple[tuple[Any, ...], Candidate]] = []
    rejected: list[Rejection] = []
    for g in groups:
        result = _evaluate(px, g, loads.get(g.phys) or _GpuLoad(), request, policy, free_gis)
        if isinstance(result, str):
            rejected.append(Rejection(g.phys if g.phys in px.gpus else None, _group_parent(g), g.info.type,
                                      g.info.name, result))
        else:
            fits.append(result)
    fits.sort(key=lambda f: f[0])
    for rank, (_, c) in enumerate(fits[1:], start=2):
        rejected.append(Rejection(c.gpu, c.parent, c.type, c.name,
                                  f"fits, ranked {rank} of {len(fits)}: {c.why}", fits=True))
    return Decision(fits[0][1] if fits else None, rejected, len(groups), request, policy)


def _group_parent(g: _Group) -> str | None:
    if g.sriov:
        return None
    return g.listed[0].parent if g.listed else g.phys


def _groups(px: Placer, allocations: list[Allocation], wanted: str) -> list[_Group]:
    # Match against the small per-model catalogue, not against thousands of per-VF listings.
    matched: dict[_Model, list[_TypeInfo]] = {}
    for model, cat in px.catalogue.items():
        hits = [i for i in cat.values() if i.matches(wanted)]
        if hits:
            matched[model] = hits
    # Types that are full everywhere drop out of the listings; existing vGPUs still name them.
    for a in allocations:
        model = px.model_of(a.gpu or px.physical(a.parent))
        if a.type in px.catalogue.get(model, {}) or any(i.type == a.type for i in matched.get(model, ())):
            continue
        info = _info_from_allocation(a)
        if info.matches(wanted):
            matched.setdefault(model, []).append(info)
    if not matched:
        matched = _matched_by_model_name(px, allocations, wanted)

    groups: dict[tuple[str, str], _Group] = {}
    for model, infos in matched.items():
        for phys in px.members(model):
            for info in infos:
                listed = px.listings.get((phys, info.type), [])
                sriov = phys in px.vfs_of
                if not listed and not sriov and not info.nvidia:
                    continue  # a non-NVIDIA parent that does not list the type cannot create it
                groups[(phys, info.type)] = _Group(phys, info, listed, sriov)
    return [groups[k] for k in sorted(groups)]


def _matched_by_model_name(px: Placer, allocations: list[Allocation],
                           wanted: str) -> dict[_Model, list[_TypeInfo]]:
    """A vendor-VF GPU lists only what is creatable now, so a type can be absent everywhere although
    the GPU supports it. If the wanted short name belongs to a GPU model on this host (L40S-4Q on an
    L40S), return a stand-in without a type id so the GPU is evaluated and refused with a reason."""
    parsed = ids.parse_type_name(wanted)
    if parsed is None:
        return {}
    # only vendor-VF listings shrink to "creatable now"; mdev parents list every supported type
    named = [(model, i.name, i.parsed) for model, cat in px.catalogue.items() for i in cat.values()
             if i.backend == BACKEND_NVIDIA_VF]
    named += [(px.model_of(a.gpu or px.physical(a.parent)), a.name, a.parsed) for a in allocations
              if a.name and a.backend == BACKEND_NVIDIA_VF]
    prefixes: dict[_Model, str] = {}
    for model, name, p in named:
        if p and p.gpu == parsed.gpu:
            prefixes.setdefault(model, name.rsplit(" ", 1)[0] if " " in name else "")
    fb = int(parsed.framebuffer_gb * 1024)
    out: dict[_Model, list[_TypeInfo]] = {}
    for model, prefix in prefixes.items():
        name = f"{prefix} {parsed.short}".strip()
        out[model] = [_TypeInfo("", name, parsed.short, BACKEND_NVIDIA_VF, fb, None, parsed.mig_profile, 1, parsed)]
    return out


def _vfs_off(px: Placer, wanted: str) -> list[Any]:
    """The NVIDIA SR-IOV GPUs whose model offers `wanted` (NVML's catalogue) but whose VFs are all off."""
    w = wanted.lower()
    models = {model for model, cat in px.catalogue.items()
              if any(w in (i.type.lower(), i.name.lower(), i.short.lower()) for i in cat.values())}
    return [g for g in px.inv.gpus if g.physfn is None and g.vendor_id == "10de" and (g.vendor_id, g.device_id)
            in models and g.sriov is not None and g.sriov.totalvfs and not g.sriov.numvfs]


def _close_names(px: Placer, wanted: str) -> str:
    names: dict[str, str] = {}
    for cat in px.catalogue.values():
        for i in cat.values():
            names.setdefault(i.short.lower(), i.short)
            names.setdefault(i.type.lower(), i.type)
    import difflib  # only for the hint of a NotFound: kept off the start path

    typed = {wanted.lower(), wanted.lower().split()[-1]}
    close = [c for c in difflib.get_close_matches(wanted.lower().split()[-1], list(names), n=6, cutoff=0.6)
             if c not in typed][:5]  # never the very name that was typed
    if close:
        return "did you mean " + ", ".join(names[c] for c in close) + "? `vgpumgr types` lists every type"
    return "`vgpumgr types` lists the types this host offers"


def _evaluate(px: Placer, g: _Group, load: _GpuLoad, request: Request, policy: Policy,
              free_gis: Mapping[str, Sequence[str]]) -> str | tuple[tuple[Any, ...], Candidate]:
    info = g.info
    gpu = px.gpus.get(g.phys)
    placement_id: int | None = None
    cost = 0
    refusal = _policy_refusal(px, g, policy)
    if refusal:
        return refusal
    allocs = load.allocations
    if info.nvidia:
        refusal = _nvidia_refusal(px, g, allocs, load.pending, request, policy, free_gis)
        if refusal:
            return refusal
        used_mb = sum(a.framebuffer_mb or 0 for a in allocs)
        region = px.region_mb(g.phys, info.name) or max(used_mb + (info.framebuffer_mb or 0), 1)
        share = min(used_mb / region, 1.0)
        usage = f"{len(allocs)} vGPU(s), {used_mb}/{region} MB"
        if policy.placement_id is not None and not px.mixed(g, policy):
            return f"placement ID {policy.placement_id} asked for, but {g.phys} is not in mixed-size mode"
        if px.mixed(g, policy) and not info.mig_profile:
            found = mixed_choice(px, g, allocs, policy)
            if isinstance(found, str):
                return found
            placement_id, cost = found
            usage += f"; placement {placement_id}, costs other types {cost} GB"
    elif g.info.backend == BACKEND_VF:  # a vendor's SR-IOV slice: one VM per VF, _pick_parent finds a free one
        vfs = px.vfs_of.get(g.phys, [])
        busy = len({a.parent for a in allocs})
        share = busy / max(len(vfs), 1)
        usage = f"{busy} of {len(vfs)} VFs in use"
    else:
        refusal, share, usage = _generic_refusal(g, load)
        if refusal:
            return refusal

    parent, free_vfs = _pick_parent(px, g, allocs, policy)
    if parent.startswith("!"):
        return parent[1:]

    numa = gpu.numa_node if gpu else None
    numa_miss = policy.numa is not None and numa != policy.numa
    why = f"{policy.strategy}: load {share:.0%} ({usage})"
    if policy.numa is not None:
        why += f"; NUMA {numa if numa is not None and numa >= 0 else '?'}" + (
            " (not the preferred node)" if numa_miss else " (preferred)")
    if free_vfs is not None:
        why += f"; {free_vfs} of {len(px.vfs_of.get(g.phys, []))} VFs free, lowest taken"
    if policy.strategy == "pack":  # GPU and placement ID chosen together (placement_ids.pack_order, bench_mixed.py)
        order = (numa_miss, *pid.pack_order(_pack_cost(px, g, policy, allocs, cost), share), g.phys, parent,
                 info.type)
    else:  # spread: the least loaded GPU, the placement's cost breaks its ties
        order = (numa_miss, share, cost, g.phys, parent, info.type)
    listed_backend = g.listed[0].backend if g.listed else info.backend
    return order, Candidate(g.phys if gpu else None, parent, info.type, info.name, listed_backend, numa,
                            round(share, 4), free_vfs, why, placement_id)


def _pack_cost(px: Placer, g: _Group, policy: Policy, allocs: list[Allocation], cost: int) -> float:
    """What a choice gives away, comparable across the GPUs `pack` ranks: in mixed-size mode the placement's
    cost; an equal-size GPU that already holds vGPUs gives nothing away (only their size fits there), an empty
    one every other size; MIG and other vendors' slices rank by load alone."""
    if not g.info.nvidia or g.info.mig_profile or px.mixed(g, policy):
        return cost
    return 0 if allocs else math.inf


def _policy_refusal(px: Placer, g: _Group, policy: Policy) -> str | None:
    if policy.pin_gpu and g.phys != policy.pin_gpu:
        return f"not the pinned GPU {policy.pin_gpu}"
    if policy.pin_parent:
        parents = {t.parent for t in g.listed} | set(px.vfs_of.get(g.phys, ())) | {g.phys}
        if policy.pin_parent not in parents:
            return f"not the pinned parent {policy.pin_parent}"
    if g.phys in policy.deny_gpus:
        return f"denied by policy (GPU {g.phys})"
    if policy.allow_models or policy.deny_models:
        names = _model_names(px, g)
        shown = next(iter(names.values()), g.phys)
        denied = [m for m in policy.deny_models if m.lower() in names]
        if denied:
            return f"denied by policy (model {names[denied[0].lower()]})"
        if policy.allow_models and not any(m.lower() in names for m in policy.allow_models):
            return f"model {shown} is not in the allowed models ({', '.join(policy.allow_models)})"
    return None


def _model_names(px: Placer, g: _Group) -> dict[str, str]:
    """Names a policy may use for this GPU's model: T4 (from the type name), the PCI name, the device id."""
    names: dict[str, str] = {}
    parsed = g.info.parsed
    if parsed:
        names[parsed.gpu.lower()] = parsed.gpu
    gpu = px.gpus.get(g.phys)
    if gpu:
        names.setdefault(gpu.name.lower(), gpu.name)
        names.setdefault(gpu.device_id.lower(), gpu.device_id)
        names.setdefault(f"{gpu.vendor_id}:{gpu.device_id}".lower(), f"{gpu.vendor_id}:{gpu.device_id}")
    return names


def _nvidia_refusal(px: Placer, g: _Group, allocs: list[Allocation], pending: list[Allocation],
                    request: Request, policy: Policy, free_gis: Mapping[str, Sequence[str]]) -> str | None:
    info = g.info
    short = info.short
    infos = [(a, px.info(g.phys, a.type) or _info_from_allocation(a)) for a in allocs]
    mig_allocs = [a for a, i in infos if i.mig_profile]
    sliced = [(a, i) for a, i in infos if not i.mig_profile]

    if request.vm and info.max_per_vm is not None:
        mine = sum(1 for a in allocs if a.vm == request.vm)
        if mine >= info.max_per_vm:
            if info.max_per_vm == 1:
                return f"VM {request.vm} already has a vGPU on this GPU"
            return f"VM {request.vm} already has {mine} vGPUs on this GPU (max {info.max_per_vm} of {short})"

    if info.mig_profile:
        if sliced:
            return f"GPU holds time-sliced vGPUs; MIG-backed {short} needs MIG mode"
        free = free_gis.get(g.phys)
        facts = px.mig_facts(g.phys)
        used = [i.mig_profile for _, i in infos if i.mig_profile]
        if free is None:  # the caller did not say: NVML's instances on the GPU, less those its vGPUs use
            if facts is None or not facts.enabled:
                return f"MIG is not enabled on this GPU; {short} needs a free {info.mig_profile} GPU instance"
            left = facts.free(used).count(info.mig_profile)
        else:
            left = free.count(info.mig_profile) - sum(
                1 for a in pending if (px.info(g.phys, a.type) or _info_from_allocation(a)).mig_profile
                == info.mig_profile)
        if left > 0:
            return None
        if facts is None or not facts.enabled:
            return f"no free {info.mig_profile} GPU instance"
        return facts.why_none_free(info.mig_profile, users_text(a.vm for a in mig_allocs), len(used))

    if mig_allocs or g.phys in free_gis:
        return f"MIG is enabled on this GPU; time-sliced {short} needs MIG off"
    need = info.framebuffer_mb or 0
    if px.mixed(g, policy):
        return None  # mixed_choice decides by placement IDs
    sizes = sorted({a.framebuffer_mb for a, _ in sliced if a.framebuffer_mb is not None})
    other = [s for s in sizes if s != need]
    if other:
        held = "/".join(str(s) for s in sizes)
        return f"equal-size mode: GPU holds {held} MB vGPUs, {short} is {need} MB"
    limit = _max_instance(px, g.phys, info)
    if limit is not None and len(sliced) >= limit:
        return f"max_instance {limit} of {short} reached on {g.phys}"
    return None


def _max_instance(px: Placer, phys: str, info: _TypeInfo) -> int | None:
    """max_instance from the description, else the rule of thumb GPU GB / type GB, capped at 32."""
    if info.max_instance:
        return info.max_instance
    region = px.region_mb(phys, info.name)
    if region and info.framebuffer_mb:
        return max(1, min(_MAX_TIMESLICED_PER_GPU, region // info.framebuffer_mb))
    return None


def _generic_refusal(g: _Group, load: _GpuLoad) -> tuple[str | None, float, str]:
    """Non-NVIDIA parents: the driver's available_instances, less records not yet created."""
    t = g.listed[0]
    reserved = sum(1 for a in load.pending if a.parent == t.parent and a.type == t.type)
    left = t.available_instances - reserved
    existing = sum(1 for a in load.allocations if a.parent == t.parent)
    share = existing / max(existing + max(left, 0), 1)
    usage = f"{existing} device(s), {max(left, 0)} more available"
    if left <= 0:
        extra = f", {reserved} reserved" if reserved else ""
        if t.type.startswith("vnpu-") and existing == 0 and t.available_instances == 0:
            extra += f" (an Ascend card offers vNPUs only in VM mode: `vgpumgr vendor prepare {t.parent}`)"
        return f"available_instances {t.available_instances} on {t.parent}{extra}", share, usage
    return None, share, usage


def _pick_parent(px: Placer, g: _Group, allocs: list[Allocation], policy: Policy) -> tuple[str, int | None]:
    """The parent to create on; '!reason' when there is none. SR-IOV: the lowest free VF."""
    short = g.info.short
    if not g.sriov:
        if not g.listed:
            return f"!{short} is not listed on {g.phys}", None
        t = g.listed[0]
        if g.info.nvidia and t.backend == BACKEND_MDEV and t.available_instances <= 0:
            return f"!driver reports available_instances 0 for {short} on {t.parent}", None
        return t.parent, None
    vfs = px.vfs_of[g.phys]
    busy = {a.parent for a in allocs}
    free = [v for v in vfs if v not in busy]
    if policy.pin_parent and policy.pin_parent != g.phys:
        if policy.pin_parent in busy:
            return f"!VF {policy.pin_parent} already holds a vGPU", len(free)
        free = [v for v in free if v == policy.pin_parent]
    if not free:
        return f"!no free VF ({len(vfs)} of {len(vfs)} VFs hold a vGPU)", 0
    creatable = {t.parent for t in g.listed if t.backend == BACKEND_NVIDIA_VF or t.available_instances > 0}
    for vf in free:
        if vf in creatable:
            return vf, len([v for v in vfs if v not in busy])
    return f"!the driver lists {short} as creatable on none of the {len(free)} free VF(s)", len(free)


# -- explain --------------------------------------------------------------------------------------


def explain_text(decision: Decision) -> str:
    """A readable table of the choice and of every other candidate with its reason."""
    head = "placement"
    if decision.request:
        head += f" of {decision.request.type}"
        if decision.request.vm:
            head += f" for VM {decision.request.vm}"
    if decision.policy:
        p = decision.policy
        bits = [p.strategy] + ([f"NUMA {p.numa} preferred"] if p.numa is not None else [])
        bits += [f"pinned to {x}" for x in (p.pin_gpu, p.pin_parent) if x]
        head += f" (policy: {', '.join(bits)})"
    head += f": {decision.considered} candidate(s) considered"
    rows: list[tuple[str, str, str, str, str]] = []
    if decision.choice:
        c = decision.choice
        rows.append(("chosen", c.gpu or "-", c.parent, _type_cell(c.name, c.type), c.why))
    for r in decision.rejected:
        result = "fits" if r.fits else "rejected"
        rows.append((result, r.gpu or "-", r.parent or "(any VF)", _type_cell(r.name, r.type), r.reason))
    lines = [head]
    if not decision.choice:
        lines.append("no parent can take this vGPU now")
    if rows:
        header = ("RESULT", "GPU", "PARENT", "TYPE", "REASON")
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
        for row in [header, *rows]:
            cells = [cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)]
            lines.append("  ".join([*cells, row[4]]))
    return "\n".join(lines)


def _type_cell(name: str, type_id: str) -> str:
    return f"{name} ({type_id})" if type_id and type_id != name else name
