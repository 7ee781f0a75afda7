"""One GPU's placement map in mixed-size mode: which GB slots each vGPU holds (and whose VM it is), and per
type its supported and creatable placement IDs, counted from the same rules placement uses (not from
framebuffer arithmetic). `vgpumgr gpu slots`, GET /v1/gpus/{address}/slots and the web view show it.

In equal-size mode a GPU has placement IDs only where NVML says so (HOMOGENEOUS_PLACEMENTS: Ada and newer, R570+):
then the map shows the homogeneous starts (`j * size`), which are taken, and, once a vGPU exists, only its size's
starts as creatable (the driver's equal-size rule). Without them (`placements` None) there is no map: no
placement IDs exist in that mode (pre-Ada, R550) or NVML cannot tell."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vgpumgr import ids
from vgpumgr.errors import NotFound
from vgpumgr.nvidia import mixed as nvml_mixed
from vgpumgr.ops.context import Context
from vgpumgr.placement import ids as pid
from vgpumgr.placement.mixed import _slots, held


def slot_map(svc: Context, gpu: str) -> dict[str, Any]:
    from vgpumgr.ops.allocate import live_records

    gpu = ids.pci_address(gpu)
    snap = svc.snapshot(refresh=True)  # the mode and placements as they are now (another process may have changed them)
    px = snap.placer
    if gpu not in px.gpus:
        raise NotFound(f"no GPU {gpu}", hint="`vgpumgr gpus` lists the GPUs")
    with svc.reads() as s:
        records = live_records(svc, s)
    allocs, _ = px.merged_allocations(records)
    mine = [a for a in allocs if (a.gpu or px.physical(a.parent)) == gpu]
    facts = nvml_mixed.facts_of(px.gpus[gpu].nvml)
    region_mb = px.region_mb(gpu)
    mode = nvml_mixed.mode_of(px.gpus[gpu].nvml)
    homogeneous = mode == "equal" and facts.get("placements") == "homogeneous"
    out: dict[str, Any] = {"gpu": gpu, "mode": mode, "capable": facts.get("capable"),
                           "placements": "homogeneous" if homogeneous else ("heterogeneous" if mode == "mixed" else
                                                                           facts.get("placements")),
                           "region_gb": region_mb // 1024 if region_mb else None, "vgpus": [], "types": []}
    if not region_mb or (mode == "equal" and not homogeneous):  # equal size without placement IDs: no map
        return out
    region = region_mb // 1024
    taken = held(px, gpu, region, mine, homogeneous)
    out["vgpus"] = [{"placement_id": p, "size": s, "vgpu": label} for p, s, label in taken]
    occupied = [(p, s) for p, s, _ in taken]
    for info in sorted(px.catalogue.get(px.model_of(gpu), {}).values(),
                       key=lambda i: (-(i.framebuffer_mb or 0), i.name)):
        if not info.framebuffer_mb or info.mig_profile:
            continue
        size, supported = _slots(px, gpu, info, region, homogeneous)
        out["types"].append({"type": info.type, "name": info.name, "placement_size": size,
                             "supported": list(supported),
                             "creatable": pid.creatable_in_mode(region, supported, size, occupied,
                                                                equal=homogeneous)})
    out["used_gb"] = sum(s for _, s in occupied)
    return out


def mixed_size_free(svc: Context, snap: Any = None, only: Iterable[str] | None = None
                    ) -> dict[str, dict[str, int]]:
    """GPU in mixed-size mode -> type id -> vGPUs of it that could be made now, one after the other: the count
    `fleet capacity` publishes (vgpumgr.fleet.capacity), for the GPU page, `types`, REST and /metrics alike. The
    records are read only when a GPU is in that mode."""
    from vgpumgr.fleet import capacity
    from vgpumgr.ops.allocate import live_records
    from vgpumgr.placement.mixed import is_mixed

    snap = snap or svc.snapshot()
    wanted = None if only is None else set(only)
    if not any(is_mixed(g) for g in snap.inventory.gpus if wanted is None or g.address in wanted):
        return {}
    with svc.reads() as s:
        records = live_records(svc, s)
    return capacity.mixed_size_free(snap.placer, records, wanted)


def with_gpu_available(rows: list[dict[str, Any]], counts: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """Type rows (`types --json`, GET /v1/types) of a GPU in mixed-size mode get `gpu_available`: what the GPU can
    make of the type now (the same on each of its VFs, not to be summed); `available_instances` stays the VF's own."""
    for r in rows:
        n = counts.get(r.get("gpu") or "", {}).get(r["type"])
        if n is not None:
            r["gpu_available"] = n
    return rows


def cells(m: dict[str, Any]) -> list[str | None]:
    """Per GB slot, the label of the vGPU holding it (None: free)."""
    row: list[str | None] = [None] * (m.get("region_gb") or 0)
    for v in m["vgpus"]:
        for i in range(v["placement_id"], min(v["placement_id"] + v["size"], len(row))):
            row[i] = v["vgpu"]
    return row


def text(m: dict[str, Any]) -> str:
    if m["mode"] == "equal" and m.get("placements") != "homogeneous":
        return (f"{m['gpu']}: equal-size vGPU mode, no placement IDs (NVML shows them in equal-size mode on Ada "
                "and newer GPUs with R570+ drivers only)\n")
    kind = " (homogeneous placement IDs)" if m.get("placements") == "homogeneous" else ""
    lines = [f"{m['gpu']}: {m['mode'] or 'unknown'}-size vGPU mode{kind}, {m.get('used_gb', 0)} of "
             f"{m['region_gb'] or '?'} GB placed"]
    row = cells(m)
    if row:
        marks: dict[str, str] = {}
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
        for label in row:
            if label is not None and label not in marks:
                marks[label] = letters[len(marks) % len(letters)]
        lines.append("map  " + "".join(marks[c] if c else "." for c in row) + "  (one character per GB)")
        lines += [f"  {k}  {label}" for label, k in marks.items()]
    lines.append("TYPE                 SIZE  CREATABLE PLACEMENT IDS (of supported)")
    for t in m["types"]:
        lines.append(f"{t['name'].split()[-1]:<20} {t['placement_size']:>4}  "
                     f"{', '.join(map(str, t['creatable'])) or '-'} (of {len(t['supported'])})")
    return "\n".join(lines) + "\n"
