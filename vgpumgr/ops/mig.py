"""MIG-backed vGPUs: reuse a free GPU instance of the profile or make one, then allocate the matching
vGPU type pinned to that GPU; a GPU instance made for a failed allocation is destroyed again."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vgpumgr.db import store
from vgpumgr.errors import NoCapacity
from vgpumgr.ops import allocate as alloc
from vgpumgr.ops import boot_records
from vgpumgr.ops.context import Context, suppress
from vgpumgr.placement.placer import Policy


def _mig_type_name(svc: Context, profile: str, gpu: str | None, series: str | None = None) -> str:
    from vgpumgr.virt.dryrun import mig_type_name

    return mig_type_name(svc.snapshot().inventory, profile, gpu, series)[0]


def allocate_mig(svc: Context, profile: str, *, vm: str | None = None, policy: Policy | None = None,
                 idempotency_key: str | None = None, actor: str | None = None, detail: dict[str, Any] | None = None,
                 lease_id: int | None = None, activate: bool = True, series: str | None = None) -> dict[str, Any]:
    """A MIG-backed vGPU: reuse or create a matching GPU instance, then place the matching type on a VF.

    Only a GPU where the VM has no vGPU yet (NVIDIA: one vGPU of a physical GPU per VM); a free instance
    before a new one. `series`: the type's series where the profile has types of several (C, Q)."""
    from vgpumgr.mig import plan as mig_plan

    profile = mig_plan.normalise_profile_name(profile)
    layer = svc.nvml()
    with svc.locked():
        if idempotency_key:
            found = alloc.by_key(svc, idempotency_key)
            if found is not None:
                return found
        seen = MigState.read(svc, layer)
        gpu, make = choose_gpu(svc, layer, profile, policy, vm, seen)
        created = None
        free = seen.free
        if make:
            created = layer.create_gpu_instance(gpu, profile)
            svc.host.kernel.gpu_instances_changed(layer)
            svc.invalidate()
            with svc.tx() as s:
                svc.event(s, "mig.gi.create", actor=actor, gpu=gpu, vm=vm, detail=created)
            free = free_gpu_instances(svc, layer)  # with the one just made
        type_name = _mig_type_name(svc, profile, gpu, series)
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


@dataclass(frozen=True)
class MigState:
    """What MIG placement reads, once: NVML's GPUs, their GPU instances no vGPU is bound to (profile names), and
    the VMs of the live MIG-backed vGPUs (None: a vGPU without a VM), by GPU."""

    gpus: dict[str, dict[str, Any]]
    free: dict[str, list[str]]
    users: dict[str, list[str | None]]

    @classmethod
    def read(cls, svc: Context, layer) -> MigState:  # noqa: ANN001
        """One read of the live rows and one of NVML's GPU list."""
        with svc.reads() as s:
            rows = store.live_rows(s, svc.host_id(s))
        gpus = layer.gpus()
        used: dict[str | None, list[str]] = {}
        users: dict[str, list[str | None]] = {}
        for a in rows:
            d = a.detail or {}
            if d.get("mig_profile"):
                used.setdefault(d.get("gpu"), []).append(d["mig_profile"])
                if d.get("gpu"):
                    users.setdefault(d["gpu"], []).append(a.vm_name)
        free: dict[str, list[str]] = {}
        for addr, g in gpus.items():
            if (g.get("mig") or {}).get("current") != "enabled":
                continue
            names = [gi["profile"] for gi in g["mig"]["gpu_instances"]]
            for p in used.get(addr, []):
                if p in names:
                    names.remove(p)
            free[addr] = names
        return cls(gpus, free, users)


def choose_gpu(svc: Context, layer, profile: str, policy: Policy | None, vm: str | None,  # noqa: ANN001
               seen: MigState | None = None) -> tuple[str, bool]:
    """(GPU, whether its GPU instance must be made) for a vGPU needing `profile`; NoCapacity naming each GPU's
    true reason otherwise (MIG off, no room for the profile and what holds its slices, the policy). `seen`: what
    the caller read (MigState.read), else read here."""
    from vgpumgr.mig.facts import MigFacts, users_text

    seen = seen or MigState.read(svc, layer)
    free, users, gpus = seen.free, seen.users, seen.gpus
    reasons: dict[str, str] = {}
    room: list[str] = []
    for addr in sorted(gpus):
        facts = MigFacts.of(gpus[addr])
        if policy and policy.pin_gpu and policy.pin_gpu != addr:
            continue
        if facts is None or not facts.enabled:
            reasons[addr] = "MIG is not enabled on this GPU"
        elif policy and addr in policy.deny_gpus:
            reasons[addr] = "excluded by the policy"
        elif vm and vm in users.get(addr, []):
            reasons[addr] = f"VM {vm} already has a vGPU on this GPU"
        elif profile in free.get(addr, []) or facts.can_make(profile):
            room.append(addr)
        else:
            reasons[addr] = facts.why_none_free(profile, users_text(users.get(addr, [])), len(users.get(addr, [])))
    if room:
        gpu = min(room, key=lambda a: (profile not in free.get(a, []), a))  # a free instance first
        return gpu, profile not in free.get(gpu, [])
    why = "; ".join(f"{a}: {r}" for a, r in reasons.items()) or "no MIG GPU here"
    raise NoCapacity(f"no GPU has room for a {profile} GPU instance: {why}",
                     hint="`vgpumgr mig list` shows the GPU instances; destroy one that holds no vGPU, or choose "
                          "a smaller profile")


def _remember_gpu_instances(svc: Context, layer, gpu: str, profile: str) -> None:  # noqa: ANN001
    """Record the GPU's instances of this profile at their placements, for `vgpumgr restore`."""
    gis = [gi for gi in (layer.gpu(gpu).get("mig") or {}).get("gpu_instances", []) if gi["profile"] == profile]
    with svc.tx() as s:
        for gi in gis:
            boot_records.remember_gpu_instance(s, svc.host_id(s), gpu, gi)


def free_gpu_instances(svc: Context, layer) -> dict[str, list[str]]:  # noqa: ANN001
    """GPU instances not yet bound to a vGPU, by GPU address (profile names)."""
    return MigState.read(svc, layer).free


def instance_ids(layer) -> set[tuple[str, int]]:  # noqa: ANN001
    """(GPU, GPU-instance id) of every GPU instance NVML reports now."""
    return {(addr, int(gi["id"])) for addr, g in layer.gpus().items()
            for gi in (g.get("mig") or {}).get("gpu_instances") or []}


def destroy_made_since(svc: Context, layer, before: set[tuple[str, int]], *,  # noqa: ANN001
                       actor: str | None = None, vm: str | None = None) -> list[tuple[str, int]]:
    """Destroy the GPU instances made since `before` (for a request that failed as a whole: a refused
    migration leaves none behind), forgetting them for `restore` too. Returns (GPU, id) of those destroyed."""
    gone = []
    for addr, gi in sorted(instance_ids(layer) - before):
        with suppress():
            res = layer.destroy_gpu_instance(addr, gi)
            gone.append((addr, gi))
            with svc.tx() as s:
                boot_records.forget_gpu_instance(s, svc.host_id(s), addr, res["start"])
                svc.event(s, "mig.gi.destroy", actor=actor, gpu=addr, vm=vm, detail=res)
    if gone:
        svc.host.kernel.gpu_instances_changed(layer)
        svc.invalidate()
    return gone
