"""MIG-backed vGPUs: reuse a free GPU instance of the profile or make one, then allocate the matching
vGPU type pinned to that GPU; a GPU instance made for a failed allocation is destroyed again."""

from __future__ import annotations

import dataclasses
from typing import Any

from vgpumgr.db import store
from vgpumgr.errors import NoCapacity, VgpuError
from vgpumgr.ops import allocate as alloc
from vgpumgr.ops import boot_records
from vgpumgr.ops.context import Context, suppress
from vgpumgr.placement import Policy


def _mig_type_name(svc: Context, profile: str, gpu: str | None) -> str:
    from vgpumgr.dryrun import mig_type_name

    return mig_type_name(svc.snapshot().inventory, profile, gpu)[0]

def allocate_mig(svc: Context, profile: str, *, vm: str | None = None, policy: Policy | None = None,
                 idempotency_key: str | None = None, actor: str | None = None, detail: dict[str, Any] | None = None,
                 lease_id: int | None = None, activate: bool = True) -> dict[str, Any]:
    """A MIG-backed vGPU: reuse or create a matching GPU instance, then place the matching type on a VF."""
    from vgpumgr import mig as mig_plan

    profile = mig_plan.normalise_profile_name(profile)
    layer = svc.nvml()
    with svc.locked():
        if idempotency_key:
            found = alloc.by_key(svc, idempotency_key)
            if found is not None:
                return found
        created = None
        denied = policy.deny_gpus if policy else frozenset()
        free = free_gpu_instances(svc, layer)
        if not any(profile in v for a, v in free.items() if a not in denied):
            gpu = _gpu_for_new_instance(svc, layer, profile, policy)
            created = layer.create_gpu_instance(gpu, profile)
            svc.host.kernel.gpu_instances_changed(layer)
            svc.invalidate()
            with svc.tx() as s:
                svc.event(s, "mig.gi.create", actor=actor, gpu=gpu, vm=vm, detail=created)
            free = free_gpu_instances(svc, layer)
        gpu = next(a for a in sorted(free) if profile in free[a] and a not in denied)
        type_name = _mig_type_name(svc, profile, gpu)
        pinned = dataclasses.replace(policy or Policy(), pin_gpu=gpu)
        try:
            result = alloc.allocate(svc, type_name, vm=vm, policy=pinned, idempotency_key=idempotency_key,
                                    actor=actor, detail={**(detail or {}), "mig_profile": profile},
                                    free_gpu_instances=free, lease_id=lease_id, activate=activate)
        except BaseException:
            if created:
                with suppress():
                    layer.destroy_gpu_instance(created["address"], created["gpu_instance"]["id"])
                    svc.host.kernel.gpu_instances_changed(layer)
                    svc.invalidate()
            raise
        _remember_gpu_instances(svc, layer, gpu, profile)
        return result


def _remember_gpu_instances(svc: Context, layer, gpu: str, profile: str) -> None:  # noqa: ANN001
    """Record the GPU's instances of this profile at their placements, for `vgpumgr restore`."""
    gis = [gi for gi in (layer.gpu(gpu).get("mig") or {}).get("gpu_instances", []) if gi["profile"] == profile]
    with svc.tx() as s:
        for gi in gis:
            boot_records.remember_gpu_instance(s, svc.host_id(s), gpu, gi)


def free_gpu_instances(svc: Context, layer) -> dict[str, list[str]]:  # noqa: ANN001
    """GPU instances not yet bound to a vGPU, by GPU address (profile names)."""
    with svc.sessions() as s:
        used: dict[str, list[str]] = {}
        for a in store.allocations(s, svc.host_id(s), live=True):
            p = (a.detail or {}).get("mig_profile")
            if p:
                used.setdefault((a.detail or {}).get("gpu"), []).append(p)
    out: dict[str, list[str]] = {}
    for addr, g in layer.gpus().items():
        if (g.get("mig") or {}).get("current") != "enabled":
            continue
        names = [gi["profile"] for gi in g["mig"]["gpu_instances"]]
        for p in used.get(addr, []):
            if p in names:
                names.remove(p)
        out[addr] = names
    return out

def _gpu_for_new_instance(svc: Context, layer, profile: str, policy: Policy | None) -> str:  # noqa: ANN001
    from vgpumgr import mig as mig_plan

    reasons = []
    for addr in sorted(layer.gpus()):
        g = layer.gpus()[addr]
        if (g.get("mig") or {}).get("current") != "enabled":
            reasons.append(f"{addr}: MIG is off")
            continue
        if policy and policy.pin_gpu and policy.pin_gpu != addr:
            continue
        if policy and addr in policy.deny_gpus:
            reasons.append(f"{addr}: excluded by the policy")
            continue
        try:
            table = layer.mig_table(addr)
            mig_plan.plan(table, layer.gpu_instances(addr), table.find(profile))
            return addr
        except VgpuError as e:
            reasons.append(f"{addr}: {e.message}")
    raise NoCapacity(f"no GPU has room for a {profile} GPU instance", hint="; ".join(reasons) or "no MIG GPU")
