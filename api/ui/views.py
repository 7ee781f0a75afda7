"""What the pages show, built from the Service's snapshot and records. Read-only: no page changes anything here.

The slot map of a GPU comes from the same inventory `vgpumgr types` reads (mdev types, VF vGPUs) and the same
NVML facts `vgpumgr mig list` prints (MIG profiles, GPU instances and their placements); why a type cannot be
created now is the placement engine's own reason, as `vgpumgr place --explain` gives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vgpumgr.mig import plan as mig
from vgpumgr.model import BACKEND_VF, Gpu, Inventory
from vgpumgr.placement.placer import Policy, mig_profile_for
from vgpumgr.service import Service

MAX_BOXES = 48  # slot boxes drawn per type; more are summarised as a number


@dataclass
class Instance:
    ref: str  # mdev UUID or VF address
    parent: str
    type: str
    type_name: str | None
    vm: str | None
    state: str | None  # None: on the host but not recorded by vgpumgr (reconcile lists it)


@dataclass
class TypeRow:
    type: str
    name: str
    backend: str
    framebuffer_mb: int | None
    max_instance: int | None
    parents: list[str]
    available: int
    mig_profile: str | None
    instances: list[Instance] = field(default_factory=list)
    reason: str | None = None
    per_gpu: bool = False  # mixed-size mode: `available` counts what placement can make now, not the VFs' listing

    @property
    def boxes(self) -> list[str]:
        """'used' then 'free' slot boxes, capped at MAX_BOXES."""
        return (["used"] * len(self.instances) + ["free"] * self.available)[:MAX_BOXES]


@dataclass
class VfRow:
    address: str
    instance: Instance | None
    creatable: int  # types the driver lists as creatable on this VF now


@dataclass
class GiBox:
    id: int
    profile: str
    start: int
    size: int
    left_pct: float
    width_pct: float


@dataclass
class MigProfileRow:
    name: str
    id: int
    size: int
    starts: list[int]
    free_starts: list[int]
    remaining: int | None
    reason: str | None


@dataclass
class MigView:
    current: str | None
    pending: str | None
    slices: int
    instances: list[GiBox]
    profiles: list[MigProfileRow]
    free_slices: list[int]
    bound: dict[str, list[str]]  # profile -> VMs of live MIG-backed vGPUs


@dataclass
class SlotMap:
    gpu: Gpu
    types: list[TypeRow]
    instances: list[Instance]
    vfs: list[VfRow]
    mig: MigView | None


def live_by_ref(svc: Service) -> dict[str, dict[str, Any]]:
    return {a.get("uuid") or a.get("pci_address"): a for a in svc.allocations(live=True)}


def free_gpu_instances(inv: Inventory, live: list[dict[str, Any]]) -> dict[str, list[str]]:
    """GPU-instance profiles not yet taken by a MIG-backed vGPU, per MIG-enabled GPU."""
    out: dict[str, list[str]] = {}
    for g in inv.gpus:
        m = (g.nvml or {}).get("mig") or {}
        if m.get("current") != "enabled":
            continue
        names = [gi["profile"] for gi in m.get("gpu_instances", [])]
        for a in live:
            p = mig_profile_for(a.get("type_name") or "")
            if a.get("gpu") == g.address and p in names:
                names.remove(p)
        out[g.address] = names
    return out


def physical_gpus(inv: Inventory) -> list[Gpu]:
    return [g for g in inv.gpus if not g.is_vf]


def overview_rows(inv: Inventory, live: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for g in physical_gpus(inv):
        types = [t for t in inv.types if t.gpu == g.address or t.parent == g.address]
        used = [m for m in inv.mdevs if m.gpu == g.address or m.parent == g.address]
        used += [v for v in inv.vf_vgpus if v.gpu == g.address]
        mig_state = ((g.nvml or {}).get("mig") or {}).get("current")
        rows.append({"gpu": g, "types": len({t.type for t in types}),
                     "creatable": len({t.type for t in types if t.available_instances > 0}),
                     "vgpus": len(used), "vms": sorted({live[r]["vm"] for r in _refs(used) if r in live
                                                       and live[r]["vm"]}),
                     "mig": mig_state})
    return rows


def _refs(devices: list[Any]) -> list[str]:
    return [getattr(d, "uuid", None) or d.address for d in devices]


def _instance(ref: str, parent: str, type_id: str, type_name: str | None, live: dict[str, dict[str, Any]]
              ) -> Instance:
    a = live.get(ref)
    return Instance(ref, parent, type_id, type_name or (a or {}).get("type_name"), (a or {}).get("vm"),
                    (a or {}).get("state"))


def slot_map(svc: Service, address: str) -> SlotMap | None:
    from vgpumgr.ops.slot_map import mixed_size_free

    snap = svc.snapshot()
    inv = snap.inventory
    gpu = inv.gpu(address)
    if gpu is None:
        return None
    records = svc.allocations(live=True)
    live = {a.get("uuid") or a.get("pci_address"): a for a in records}
    names = {t.type: t.name for t in inv.types}
    instances = [_instance(m.uuid, m.parent, m.type, names.get(m.type), live)
                 for m in inv.mdevs if m.gpu == address or m.parent == address]
    instances += [_instance(v.address, v.address, v.type, v.name, live) for v in inv.vf_vgpus if v.gpu == address]
    # another vendor's whole VFs given to VMs: only the records know which are taken (nothing is written to the VF)
    instances += [_instance(a["pci_address"], a["pci_address"], a["type"], a["type_name"], live) for a in records
                  if a["backend"] == BACKEND_VF and a["gpu"] == address]
    rows: dict[str, TypeRow] = {}
    for t in inv.types:
        if t.gpu != address and t.parent != address:
            continue
        row = rows.get(t.type)
        if row is None:
            row = rows[t.type] = TypeRow(t.type, t.name, t.backend, t.framebuffer_mb, t.max_instance, [], 0,
                                         mig_profile_for(t.name or ""))
        row.parents.append(t.parent)
        row.available += 0 if t.backend == BACKEND_VF and t.parent in live else t.available_instances
    for i in instances:
        if i.type in rows:
            rows[i.type].instances.append(i)
    for type_id, n in mixed_size_free(svc, snap, [address]).get(address, {}).items():
        info = snap.placer.info(address, type_id)
        if type_id not in rows and info is not None:  # no free VF lists it: none fits, and the page says why
            rows[type_id] = TypeRow(type_id, info.name, info.backend, info.framebuffer_mb, info.max_instance, [], 0,
                                    info.mig_profile)
        if type_id in rows:
            rows[type_id].available, rows[type_id].per_gpu = n, True
    free_gis = free_gpu_instances(inv, records)
    for row in rows.values():
        if row.available == 0:
            row.reason = _why_not(svc, row, address, free_gis)
    vfs = []
    if gpu.sriov:
        by_parent = {i.parent: i for i in instances}
        for vf in gpu.sriov.vfs:
            creatable = sum(1 for t in inv.types if t.parent == vf and t.available_instances > 0
                            and not (t.backend == BACKEND_VF and vf in live))
            vfs.append(VfRow(vf, by_parent.get(vf), creatable))
    return SlotMap(gpu, sorted(rows.values(), key=lambda r: (r.backend, r.framebuffer_mb or 0, r.type)),
                   instances, vfs, _mig_view(gpu, records))


def _why_not(svc: Service, row: TypeRow, address: str, free_gis: dict[str, list[str]]) -> str:
    decision = svc.place(row.type, policy=Policy(pin_gpu=address), free_gpu_instances=free_gis)
    if decision.choice is not None:
        return "sysfs lists no free instance, yet placement would use " + decision.choice.parent
    reasons = dict.fromkeys(r.reason for r in decision.rejected if not r.fits)
    return "; ".join(reasons) or "the driver lists no available instance"


def _mig_view(gpu: Gpu, records: list[dict[str, Any]]) -> MigView | None:
    m = (gpu.nvml or {}).get("mig") or {}
    if not m.get("supported"):
        return None
    profiles = m.get("profiles") or []
    table = mig.ProfileTable.from_json(profiles)
    gis = m.get("gpu_instances") or []
    placed = [mig.Placed(int(g["profile_id"]), int(g["start"]), int(g["size"]), int(g["id"])) for g in gis]
    total = max(table.memory_slices, 1)
    boxes = [GiBox(int(g["id"]), str(g.get("profile")), int(g["start"]), int(g["size"]),
                   100.0 * int(g["start"]) / total, 100.0 * int(g["size"]) / total) for g in gis]
    rows = []
    enabled = m.get("current") == "enabled"
    for p in table.profiles:
        free = mig.free_starts(table, placed, p) if enabled else []
        reason = None if free else ("MIG mode is off on this GPU" if not enabled
                                    else mig.no_room(table, placed, p))
        remaining = next((d.get("remaining") for d in profiles if int(d["id"]) == p.id), None)
        rows.append(MigProfileRow(p.name, p.id, p.size, list(p.starts), free, remaining, reason))
    used = {s for gi in placed for s in gi.slices}
    bound: dict[str, list[str]] = {}
    for a in records:
        profile = mig_profile_for(a.get("type_name") or "")
        if profile and a.get("gpu") == gpu.address:
            bound.setdefault(profile, []).append(a.get("vm") or "(no VM)")
    return MigView(m.get("current"), m.get("pending"), table.memory_slices, boxes, rows,
                   [s for s in range(table.memory_slices) if s not in used], bound)


# -- the fleet page -------------------------------------------------------------------------------------------

MAX_FLEET_BOXES = 32  # slot boxes per type and GPU on the fleet page


def fleet_boxes(slot: dict[str, Any]) -> list[str]:
    """'used' then 'free' boxes of one type on one GPU, capped."""
    return (["used"] * slot["used"] + ["free"] * slot["free"])[:MAX_FLEET_BOXES]


def host_pages(endpoint: str | None, me: str, host: str) -> str | None:
    """Where a host's own pages are: this host's here, another's at its published http(s) endpoint."""
    if host == me:
        return "/ui/"
    if endpoint and endpoint.startswith(("http://", "https://")):
        return endpoint.rstrip("/") + "/ui/"
    return None  # a unix socket: no browser reaches it
