"""One telemetry snapshot of this host: NVML's vGPU readings joined with vgpumgr's records (docs/sources.md §19).

The join: an mdev vGPU by its UUID; a vendor-VF vGPU (no mdev) by its VM (NVML's VM id is the libvirt domain
UUID) on the same physical GPU; the VM's name from libvirt (so a renamed VM shows under its new name) or the
record. Each row carries the allocation, its placement (GPU, parent) and its licence seat. `/metrics`, `vgpumgr
top` and the web view all render the same snapshot: they cannot disagree.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from vgpumgr.model import BACKEND_NVIDIA_VF
from vgpumgr.ops.context import Context
from vgpumgr.telemetry.read import ENGINES, GpuReading, Reader, VgpuReading


def live_records(svc: Context) -> list[dict[str, Any]]:
    """The live allocations with what the join needs, in one query (no lookups per row)."""
    from vgpumgr.db import store

    with svc.reads() as s:
        rows = store.seated_rows(s, svc.host_id(s))
    return [{"id": r.id, "uuid": r.uuid, "pci_address": r.pci_address, "backend": r.backend, "parent": r.parent,
             "gpu": (r.detail or {}).get("gpu"), "type": r.type_id, "type_name": r.type_name, "series": r.series,
             "vm": r.vm_name, "licence": r.edition,
             "activated_at": r.activated_at.isoformat() if r.activated_at else None} for r in rows]


def _domains(svc: Context) -> dict[str, str]:
    """libvirt domain UUID -> name ({} when libvirt cannot be asked)."""
    from vgpumgr.errors import VgpuError

    try:
        with svc.virt() as v:
            return {d["uuid"].lower(): d["name"] for d in v.list()}
    except VgpuError:
        return {}


def _match(r: VgpuReading, vm_name: str | None, by_ref: dict[str, dict[str, Any]],
           vf_records: dict[tuple[str, str, str], dict[str, Any]]) -> dict[str, Any] | None:
    if r.mdev_uuid and r.mdev_uuid in by_ref:
        return by_ref[r.mdev_uuid]
    if vm_name and r.type_id is not None:
        return vf_records.get((vm_name, r.gpu, f"nvidia-{r.type_id}"))
    return None


def take(svc: Context, reader: Reader, guests: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The snapshot as plain data (JSON-ready): {"taken", "host", "vgpus": [...], "gpus": [...], "absent": [...],
    "guests": [...]}; `guests`: the guest-side readings' cache (vgpumgr.telemetry.guest_sampler), copied as is."""
    taken = time.time()
    gpus, notices = reader.read()
    records = live_records(svc)
    by_ref = {a["uuid"]: a for a in records if a.get("uuid")}
    vf_records = {(a["vm"], a.get("gpu"), a["type"]): a for a in records
                  if a["backend"] == BACKEND_NVIDIA_VF and a.get("vm")}
    names = _domains(svc) if any(g.vgpus for g in gpus) else {}
    rows = []
    for g in gpus:
        for r in g.vgpus:
            vm_name = names.get(r.vm_uuid or "")
            a = _match(r, vm_name, by_ref, vf_records)
            rows.append(_row(svc.hostname, r, vm_name or (a or {}).get("vm"), a))
    return {"taken": taken, "host": svc.hostname, "vgpus": sorted(rows, key=lambda x: -x["load"]),
            "gpus": _gpu_rows(svc, gpus, rows), "notices": notices,
            "absent": [{"gpu": g.address, "reason": g.absent} for g in gpus if g.absent],
            "guests": [{**r, "host": svc.hostname} for r in guests or ()]}


def _row(host: str, r: VgpuReading, vm: str | None, a: dict[str, Any] | None) -> dict[str, Any]:
    short = (r.type_name or "").split()[-1] if r.type_name else (a or {}).get("type")
    return {
        "host": host, "gpu": r.gpu, "vm": vm, "vm_uuid": r.vm_uuid, "type": short, "type_name": r.type_name,
        "vgpu": r.mdev_uuid or (a or {}).get("pci_address"), "instance": r.instance,
        "allocation_id": (a or {}).get("id"), "parent": (a or {}).get("parent"), "seat": (a or {}).get("licence"),
        "recorded": a is not None, "util": r.util, "load": r.load,
        "fb_used_bytes": r.fb_used_bytes, "fb_total_bytes": r.fb_total_bytes,
        "encoder": {"sessions": r.encoder_sessions, "fps": r.encoder_fps, "latency_s": r.encoder_latency_s},
        "fbc": {"sessions": r.fbc_sessions, "fps": r.fbc_fps, "latency_s": r.fbc_latency_s},
        "source": "host", "frame_rate_limit": r.frame_rate_limit, "gpu_instance": r.gpu_instance,
        "guest_driver": r.guest_driver,
        "licence": {"state": r.licence_state, "licensed": r.licensed, "expiry": r.licence_expiry},
        "scheduler": r.scheduler,
        "absent": r.absent,
    }


def _gpu_rows(svc: Context, gpus: list[GpuReading], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from vgpumgr.ops.slot_map import mixed_size_free

    snap = svc.snapshot()
    inv = snap.inventory
    free: dict[str, dict[str, int]] = defaultdict(dict)
    mixed = mixed_size_free(svc, snap)  # there the VFs' listings do not add up to what can be made
    for t in inv.types:
        if t.gpu and t.gpu not in mixed:
            short = t.name.split()[-1] if t.name else t.type
            free[t.gpu][short] = free[t.gpu].get(short, 0) + t.available_instances
    for gpu, by_type in mixed.items():
        for type_id, n in by_type.items():
            info = snap.placer.info(gpu, type_id)
            free[gpu][info.short if info else type_id] = n
    out = []
    for g in gpus:
        mine = [x for x in rows if x["gpu"] == g.address]
        util = {e: sum(x["util"].get(e) or 0.0 for x in mine) for e in ENGINES}
        fb = sum(x["fb_used_bytes"] or 0 for x in mine)
        out.append({"gpu": g.address, "host": svc.hostname, "vgpus": len(mine), "util": util, "fb_used_bytes": fb,
                    "free_slots": dict(sorted(free.get(g.address, {}).items())), "absent": g.absent,
                    "scheduler": g.scheduler})
    return out
