"""`vgpumgr host drain`: empty this host of its running vGPU VMs, one live migration at a time.

The host is cordoned first (nothing new is placed on it, no migration comes in) and stays so until
`vgpumgr host uncordon`. Each running VM with a vGPU goes to the first destination that can take it: where a
destination's vgpumgr service is named, its preflight decides without changing anything; otherwise the
migration is tried and the destination's `migrate begin` hook refuses early (libvirt cancels, the VM runs on
here, nothing is left on either side). What could not move, and every destination's reason, is reported.

With no destination named, the fleet chooses: for each VM, `fleet place --vm` over what the hosts sharing this
database published (NVIDIA's migration rules included), its ranked hosts tried in order at their published
migration URIs, and every host it passed over named with its reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from vgpumgr.errors import InvalidInput, VgpuError
from vgpumgr.fleet.place import FleetRequest
from vgpumgr.fleet.remote import Remote
from vgpumgr.ops import allocate as alloc
from vgpumgr.ops import fleet as fleet_ops
from vgpumgr.ops.context import Context
from vgpumgr.ops.cordon import cordon_host
from vgpumgr.ops.migrate import RUNNING, migrate_vm

DRAIN = "host.drain"


def _running_vms(svc: Context) -> list[str]:
    """The VMs running here with a vGPU vgpumgr recorded."""
    with svc.virt() as v:
        running = {d["name"] for d in v.list() if d["state"] in RUNNING}
    return sorted({a["vm"] for a in alloc.allocations(svc, live=True) if a["vm"] in running})


def drain(svc: Context, destinations: list[tuple[str, Remote | None]] | None, *, reason: str | None = None,
          actor: str | None = None, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`destinations`: (libvirt URI, its vgpumgr service or None), tried in order for each VM; none: the fleet's
    choice for each VM."""
    # with nothing running here, draining is only the cordon (a rolling upgrade's first step on an idle host)
    if not destinations and not any(h["host"] != svc.hostname for h in fleet_ops.hosts(svc)) and _running_vms(svc):
        raise InvalidInput("no destination to drain to: none given, and no other host of a fleet has published",
                           hint="give one or more --to URI (qemu+ssh://HOST/system), or share VGPUMGR_DB with the "
                                "other hosts (each running `vgpumgr serve`) so the fleet can choose")
    say = say or (lambda _line: None)
    cordon = cordon_host(svc, reason=reason or "draining", actor=actor)
    vms = _running_vms(svc)  # read again once cordoned: nothing can arrive after this list
    moved, stayed = [], []
    for n, vm in enumerate(vms, 1):
        reasons: dict[str, str] = {}
        for uri, dest in destinations or _fleet_choice(svc, vm, reasons):
            say(f"[{n}/{len(vms)}] {vm} -> {uri}")
            try:
                if dest is not None:
                    check = migrate_vm(svc, vm, uri, dest=dest, dry_run=True, actor=actor)
                    if not check["ok"]:
                        reasons[uri] = "; ".join(check["refusals"])
                        continue
                res = migrate_vm(svc, vm, uri, dest=dest, actor=actor)
            except VgpuError as e:
                reasons[uri] = e.message
                continue
            moved.append({"vm": vm, "to": uri, "migration": res["migration"], "seconds": res["seconds"]})
            break
        else:
            stayed.append({"vm": vm, "reasons": reasons})
    result = {"host": cordon["host"], "cordoned": True, "moved": moved, "stayed": stayed}
    with svc.tx() as s:
        svc.event(s, DRAIN, "ok" if not stayed else "warning", actor=actor, detail=result)
    return result


def _fleet_choice(svc: Context, vm: str, reasons: dict[str, str]) -> list[tuple[str, Remote | None]]:
    """The hosts the fleet ranks for `vm` (by its most numerous vGPU type), best first; the others' reasons go
    into `reasons`. Their hooks have the last word."""
    kinds = Counter(a["type_name"] or a["type"] for a in alloc.allocations(svc, vm=vm, live=True))
    if not kinds:
        return []
    vgpu_type, count = kinds.most_common(1)[0]
    try:
        d = fleet_ops.place(svc, FleetRequest(type=vgpu_type, vm=vm, count=count))
    except VgpuError as e:
        reasons["fleet"] = e.message
        return []
    for r in d.rejected:
        if r.host != svc.hostname:
            reasons[r.host] = r.reason
    return [(c.migration_uri, None) for c in d.ranked if c.host != svc.hostname and c.migration_uri]
