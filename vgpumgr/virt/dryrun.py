"""What `vm create --print-xml` would define: placement on the current host, rendered and validated XML.

A dry run changes nothing and takes no lock. It places on what sysfs shows now (plus, through the
service, vgpumgr's reserved records); for MIG-backed vGPUs it assumes a matching GPU instance can be
made where MIG is on. It imports neither SQLAlchemy nor libvirt, so the CLI answers quickly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vgpumgr import ids
from vgpumgr.errors import NoCapacity, NotFound
from vgpumgr.model import BACKEND_MDEV, BACKEND_VF, Inventory
from vgpumgr.placement.placer import Allocation, Placer, Policy, Request
from vgpumgr.placement.whole import pick


def mig_type_name(inv: Inventory, profile: str, gpu: str | None = None, series: str | None = None
                  ) -> tuple[str, str | None]:
    """(vGPU type name, GPU) for a MIG profile, from the listed types or NVML's catalogue of each GPU;
    `series` picks among types of several series (C, Q) for the same profile."""
    from vgpumgr.mig.plan import mig_type_for_profile, normalise_profile_name

    profile = normalise_profile_name(profile)
    names: dict[str, str | None] = {}
    for t in inv.types:
        if t.mig_slices and (gpu is None or t.gpu == gpu):
            names.setdefault(t.name, t.gpu)
    for g in inv.gpus:
        if gpu is not None and g.address != gpu:
            continue
        for t in ((g.nvml or {}).get("vgpu") or {}).get("supported_types") or []:
            if t.get("mig_profile"):
                names.setdefault(t["name"], g.address)
    if not names:
        raise NotFound(f"no MIG-backed vGPU type for {profile} on this host",
                       hint="MIG-backed vGPU needs a MIG-enabled GPU with VFs and a vGPU host driver (`vgpumgr gpus`)")
    chosen = mig_type_for_profile(sorted(names), profile, series)
    name = chosen if isinstance(chosen, str) else getattr(chosen, "name", str(chosen))
    return name, names[name]


def mig_gpus(inv: Inventory) -> list[str]:
    return [g.address for g in inv.gpus if ((g.nvml or {}).get("mig") or {}).get("current") == "enabled"]


def plan_hostdevs(inv: Inventory, placer: Placer, records: Sequence[Allocation], name: str, vgpus: Sequence[str],
                  passthrough: Sequence[str], mig: Sequence[str], policy: Policy | None, display: bool
                  ) -> list[Any]:
    from vgpumgr.virt.domain import Hostdev

    out: list[Hostdev] = []
    taken: list[Allocation] = []
    wanted = [(t, None) for t in vgpus] + [(mig_type_name(inv, p)[0], p) for p in mig]
    for type_name, profile in wanted:
        free = {g: [profile] for g in mig_gpus(inv)} if profile else None
        d = placer.place(list(records) + taken, Request(type_name, name), policy or Policy(), free_gpu_instances=free)
        c = d.choice
        if c is None and profile:
            c = _free_mig_vf(inv, records, taken, type_name)
        if c is None:
            raise NoCapacity(f"no GPU can take a {type_name} vGPU now: {d.summary()}",
                             hint="`vgpumgr place --type ... --explain` shows why")
        ref = ids.new_uuid() if c.backend == BACKEND_MDEV else c.parent
        taken.append(Allocation(gpu=c.gpu, parent=c.parent, type=c.type, framebuffer_mb=None, vm=name,
                                backend=c.backend, id=ref, name=c.name))
        out.append(Hostdev("mdev", uuid=ref, display=display and not out) if c.backend == BACKEND_MDEV
                   else Hostdev("passthrough", address=ref) if c.backend == BACKEND_VF  # a vendor's whole VF
                   else Hostdev("nvidia-vf", address=ref))
    chosen: list[str] = [ids.pci_address(a) for a in passthrough if ids.is_pci_address(a)]
    for a in passthrough:  # a model name: the card a create would pick (placement_whole.pick)
        address = ids.pci_address(a) if ids.is_pci_address(a) else pick(inv, {r.gpu or "" for r in records}
                                                                         | set(chosen), a)[0]
        chosen.append(address)
        out.append(Hostdev("passthrough", address=address))
    return out


def _free_mig_vf(inv: Inventory, records: Sequence[Allocation], taken: Sequence[Allocation], type_name: str
                 ) -> Any:
    """Where a MIG-backed vGPU would go once its GPU instance exists: the first free VF of a MIG GPU.

    (The driver lists MIG-backed types only while a matching GPU instance is free, so placement on the
    current listing cannot see it yet.)"""
    from vgpumgr.placement.placer import Candidate

    busy = {a.parent for a in [*records, *taken]} | {m.parent for m in inv.mdevs} | {v.address for v in inv.vf_vgpus}
    for gpu in mig_gpus(inv):
        g = inv.gpu(gpu)
        for vf in (g.sriov.vfs if g and g.sriov else []):
            if vf in busy:
                continue
            listed = [t for t in inv.types if t.parent == vf and t.name == type_name]
            backend = BACKEND_MDEV if listed and listed[0].backend == BACKEND_MDEV else "nvidia-vf"
            type_id = listed[0].type if listed else "?"
            return Candidate(gpu=gpu, parent=vf, type=type_id, name=type_name, backend=backend,
                             numa_node=g.numa_node if g else -1, load=0.0, free_vfs=0,
                             why="dry run: the GPU instance would be created first")
    return None
