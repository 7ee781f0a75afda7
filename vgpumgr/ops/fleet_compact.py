"""`vgpumgr fleet compact --for TYPE [--apply] [--max-moves N] [--per-host N]`: the fewest live migrations, across
the fleet, that free a placement of TYPE on some host (as VMware DRS makes room; `gpu compact` does it for one
GPU).

The options come from vgpumgr.fleet.compaction (each GPU without room for TYPE, with the VMs that must leave it),
fewest moves first; the first whose every VM has a destination is the plan. A VM's destination is the fleet's
choice for it (`fleet place --vm`: fresh, uncordoned hosts, NVIDIA's live-migration rules: same board, same vGPU
manager), never the host being freed, with what the plan already sends there subtracted, and at most `per_host`
of the plan's moves into any one host. Each move names the VM, its host, the destination and why it fits there.

`--apply` runs on the host whose GPU is freed (all the plan's VMs run there): the moves one at a time through
`vm migrate` (vgpumgr.ops.migrate), stopping at the first failure; each migration is whole or not at all, so every
VM runs somewhere: moved, or where it was. Then this host publishes, and `fleet place` is asked again for TYPE
(`placed`). The `fleet.compact` audit event says what was applied and what failed.
"""

from __future__ import annotations

from typing import Any

from vgpumgr.errors import Conflict, InvalidInput, NoCapacity, VgpuError, error_class
from vgpumgr.fleet import compaction, store
from vgpumgr.fleet.place import FleetRequest
from vgpumgr.ids import parse_type_name
from vgpumgr.ops.context import Context

COMPACT = "fleet.compact"
MAX_MOVES = 8
PER_HOST = 2
TRIED = 200  # options whose destinations are looked for before giving up (each VM's asked for once per plan)
# destination lookups (each a `fleet place`: 25-150 ms at 10,000 hosts) `fleet place`'s hint may make before it
# says the search was cut short; `fleet compact` itself has no such limit
HINT_LOOKUPS = 4
# GPUs without room `fleet place`'s plan reads (fewest vGPUs first; `fleet compact`: compaction.CANDIDATES): past
# them it says the search was cut short too
HINT_GPUS = 32
_LEFT = ("lookups left",)


class _CutShort(Exception):
    """The plan's budget of destination lookups is spent."""


def plan(svc: Context, type_name: str, *, max_moves: int | None = MAX_MOVES, per_host: int = PER_HOST,
         fits_check: bool = True, lookups: int | None = None, gpus: int | None = None) -> dict[str, Any]:
    """The plan; with `lookups`, at most that many destination lookups, and with `gpus`, of at most that many
    GPUs (`cut_short` says when either bound was reached: a plan found is valid, yet may not be the fewest moves)."""
    from vgpumgr.ops import fleet as fleet_ops

    req = FleetRequest(type_name)  # validates the name
    if max_moves is not None and not 1 <= max_moves <= 64:
        raise InvalidInput(f"--max-moves {max_moves} is out of range", hint="give 1 to 64 migrations")
    if not 1 <= per_host <= 64:
        raise InvalidInput(f"--per-host {per_host} is out of range", hint="give 1 to 64 moves into one host")
    short = store.type_match(req.type)
    out: dict[str, Any] = {"type": short, "feasible": False, "host": None, "gpu": None, "how": None,
                           "start": None, "moves": [], "applied": [], "failed": None, "placed": None,
                           "max_moves": max_moves, "per_host": per_host, "cut_short": False}
    if fits_check:
        d = fleet_ops.place(svc, req, hint=False)
        if d.choice is not None:
            out.update(feasible=True, placed=d.choice.host, why=f"host {d.choice.host} can take {short} now")
            return out
    with svc.reads() as s:
        full = compaction.full_gpus(s, short, gpus + 1 if gpus else compaction.CANDIDATES)
        out["cut_short"] = gpus is not None and len(full) > gpus
        full = full[:gpus] if gpus else full
        held = compaction.held(s, sorted({g.host_id for g in full}))
        found = compaction.options(full, held, max_moves)
        vms: dict[int, set[str]] = {}
        for o in found[:TRIED]:
            vms.setdefault(o.host_id, set()).update(o.vms)
        by_host = {h: compaction.vm_counts(s, h, sorted(v)) for h, v in vms.items()}
        counts = {o: {vm: by_host[o.host_id][vm] for vm in o.vms if vm in by_host[o.host_id]} for o in found[:TRIED]}
    blocked: list[str] = []
    # VM -> `fleet place --vm`'s answer (or its error); (type, count) -> its hosts; _LEFT -> lookups left
    asked: dict[Any, Any] = {_LEFT: lookups}
    for tried, o in enumerate(found[:TRIED]):
        try:
            moves = _destinations(svc, o, counts[o], per_host, blocked, asked)
        except _CutShort:
            out.update(cut_short=True, why=(
                f"the plan search was cut short after {lookups} destination lookup(s), {tried} of "
                f"{min(len(found), TRIED)} option(s) tried: `vgpumgr fleet compact --for {short}` searches them all"))
            return out
        if moves is not None:
            what = (f"frees placement ID {o.start} of {short}" if o.how == compaction.PLACEMENT
                    else f"empties it for {short}")
            out.update(feasible=True, host=o.host, gpu=o.gpu, how=o.how, start=o.start, moves=moves,
                       why=f"moving {len(moves)} VM(s) off {o.gpu} on {o.host} {what}")
            return out
    if out["cut_short"]:
        out["why"] = (f"no plan frees {short} off the first {gpus} GPU(s) without room (fewest vGPUs first): "
                      f"`vgpumgr fleet compact --for {short}` searches more")
    elif not found:
        out["why"] = (f"no GPU offering {short} can be made free by at most {max_moves} live migration(s) of "
                      "running VMs" if max_moves else f"no GPU offering {short} can be made free by live migrations")
    else:
        out["why"] = (f"{len(found)} GPU(s) could be freed, but the fleet has no destination for their VMs: "
                      + "; ".join(blocked[:5]))
    return out


def _destinations(svc: Context, o: compaction.Option, counts: dict[str, dict[str, int]], per_host: int,
                  blocked: list[str], asked: dict[Any, Any]) -> list[dict[str, Any]] | None:
    planned: dict[tuple[str, str], int] = {}
    into: dict[str, int] = {}
    moves = []
    wants = []  # (VM, its vGPU types and counts, the type it moves by, how many)
    for vm in o.vms:
        kinds = counts.get(vm) or {o.type_name: 1}
        vgpu_type, n = max(kinds.items(), key=lambda kv: kv[1])
        wants.append((vm, kinds, vgpu_type, n))
    for vm, _kinds, vgpu_type, n in wants:
        if not _anywhere_else(svc, store.type_match(vgpu_type), n, o.host, asked):
            blocked.append(f"VM {vm} on {o.host}: no other host has room for {n} {store.type_match(vgpu_type)}")
            return None
    for vm, kinds, vgpu_type, n in wants:
        short = store.type_match(vgpu_type)
        d = _lookup(svc, asked, vm, type=short, vm=vm, count=n)
        if isinstance(d, VgpuError):
            blocked.append(f"VM {vm} on {o.host}: {d.message}")
            return None
        nvidia = parse_type_name(vgpu_type) is not None
        for c in d.ranked:
            room = c.free - planned.get((c.host, short), 0)  # NVIDIA: one vGPU of a GPU per VM, n GPUs for n
            if c.host == o.host or into.get(c.host, 0) >= per_host or room < n or (nvidia and c.free_gpus < n):
                continue
            planned[(c.host, short)] = planned.get((c.host, short), 0) + n
            into[c.host] = into.get(c.host, 0) + 1
            moves.append({"vm": vm, "from": o.host, "gpu": o.gpu, "to": c.host, "to_uri": c.migration_uri,
                          "vgpus": sorted(kinds), "why": c.why})
            break
        else:
            blocked.append(f"VM {vm} on {o.host}: " + (d.summary() if not d.ranked else
                                                         "its destinations are taken by the plan's other moves"))
            return None
    return moves


def _anywhere_else(svc: Context, short: str, n: int, home: str, asked: dict[Any, Any]) -> bool:
    """Whether any host but `home` could take `n` of the type now, asked once per type and count: a VM's own
    destinations are among those hosts (NVIDIA's migration rules only take hosts away), so a VM whose type
    has none is not asked for one, and an option moving it is dropped without a lookup per VM."""

    d = _lookup(svc, asked, ("type", short, n), type=short, count=n)
    if isinstance(d, VgpuError):
        return True  # not known: each VM is asked, and says why
    nvidia = parse_type_name(short) is not None
    return any(c.host != home and c.free >= n and (not nvidia or c.free_gpus >= n) for c in d.ranked)


def _lookup(svc: Context, asked: dict[Any, Any], key: Any, **request: Any) -> Any:
    """`fleet place`'s answer to `request` (or its error), asked once per plan: _CutShort when the plan's lookups
    are spent."""
    from vgpumgr.ops import fleet as fleet_ops

    if key not in asked:
        left = asked.get(_LEFT)
        if left is not None:
            if left <= 0:
                raise _CutShort
            asked[_LEFT] = left - 1
        try:
            asked[key] = fleet_ops.place(svc, FleetRequest(**request), hint=False)
        except VgpuError as e:
            asked[key] = e
    return asked[key]


def apply(svc: Context, p: dict[str, Any], actor: str | None = None) -> dict[str, Any]:
    """Run the plan's migrations one at a time from this host, stopping at the first that fails."""
    from vgpumgr.ops import fleet as fleet_ops
    from vgpumgr.ops.migrate import migrate_vm

    if not p["feasible"] or not p["moves"]:
        return p
    if p["host"] != svc.hostname:
        raise Conflict(f"the plan moves VMs off {p['gpu']} on host {p['host']}, and this is {svc.hostname}",
                       hint=f"run `vgpumgr fleet compact --for {p['type']} --apply` on {p['host']} (or POST "
                            f"/v1/fleet/compact there): a VM is migrated by its own host")
    for mv in p["moves"]:
        if not mv["to_uri"]:
            p["failed"] = {"vm": mv["vm"], "to": mv["to"], "error": f"host {mv['to']} published no migration URI",
                           "hint": "set VGPUMGR_MIGRATION_URI there", "kind": Conflict.kind}
            break
        try:
            res = migrate_vm(svc, mv["vm"], mv["to_uri"], actor=actor)
        except VgpuError as e:
            p["failed"] = {"vm": mv["vm"], "to": mv["to"], "error": e.message, "hint": e.hint, "kind": e.kind}
            break
        p["applied"].append({"vm": mv["vm"], "to": mv["to"], "migration": res["migration"]})
    svc.invalidate()
    if p["applied"]:
        fleet_ops.publish(svc)
    d = fleet_ops.place(svc, FleetRequest(p["type"]), hint=False)
    p["placed"] = d.choice.host if d.choice else None
    err = failure(p)
    with svc.tx() as s:
        svc.event(s, COMPACT, "ok" if err is None else "failed", actor=actor, gpu=p["gpu"],
                  error=err.message if err else None,
                  detail={k: p.get(k) for k in ("type", "host", "how", "start", "applied", "failed", "placed")})
    return p


def failure(p: dict[str, Any]) -> VgpuError | None:
    moved = ", ".join(f"{a['vm']} to {a['to']}" for a in p["applied"]) or "nothing"
    f = p.get("failed")
    if f:
        return error_class(f["kind"])(
            f"compacting the fleet for {p['type']} stopped: migrating VM {f['vm']} to {f['to']} failed: "
            f"{f['error']}; already moved: {moved}",
            hint=(f"{f['hint']}; " if f.get("hint") else "") + f"VM {f['vm']} was not moved (it runs on "
            f"{p['host']}); run `vgpumgr fleet compact --for {p['type']}` again for a new plan")
    if not p["feasible"]:
        return NoCapacity(f"no plan frees a placement of {p['type']}: {p['why']}",
                          hint="raise --max-moves or --per-host, uncordon a host, or add capacity")
    return None


def text(p: dict[str, Any]) -> str:
    lines = [f"{p['type']}: {p['why']}"]
    for mv in p["moves"]:
        done = " [done]" if any(a["vm"] == mv["vm"] for a in p["applied"]) else (
            " [failed]" if (p.get("failed") or {}).get("vm") == mv["vm"] else "")
        lines.append(f"  move {mv['vm']} ({', '.join(mv['vgpus'])}) from {mv['from']} to {mv['to']}: {mv['why']}"
                     + done)
    if p["applied"] or (p["feasible"] and not p["moves"]):
        lines.append(f"{p['type']} places on host {p['placed']} now" if p["placed"] else
                     f"{p['type']} does not place yet (the hosts publish their changes; ask `fleet place` again)")
    return "\n".join(lines) + "\n"


def place(svc: Context, request: FleetRequest, *, every_host: bool = False) -> Any:
    """`fleet place` (vgpumgr.ops.fleet.place) with, when no host can take one vGPU, the fewest migrations that
    make room in its `compact` hint: the single GPU whose `gpu compact` frees a start, or the fleet's plan when
    it needs fewer moves or is the only one; the plan's moves either way (`plan`: VM, from, to, why). The plan
    is searched with at most HINT_LOOKUPS destination lookups over HINT_GPUS GPUs, and a large fleet's hint reads
    its GPUs with the most room up to a bound (vgpumgr.ops.fleet.FRAGMENTED_GPUS): past any bound `cut_short` and
    `full_plan` (`fleet compact --for TYPE`, which searches further) say so."""
    from dataclasses import replace

    from vgpumgr.ops import fleet as fleet_ops

    d = fleet_ops.place(svc, request, every_host=every_host)
    if d.choice is not None or request.count != 1 or request.vm is not None:
        return d
    hinted = d.compact or {}
    single = hinted if hinted.get("host") else None
    p = plan(svc, request.type, fits_check=False, lookups=HINT_LOOKUPS, gpus=HINT_GPUS)
    cut = fleet_ops.cut_short(p["type"]) if p["cut_short"] or hinted.get("cut_short") else {}
    if not (p["feasible"] and p["moves"]):
        if single is None:
            return d if not cut else replace(d, compact={
                **fleet_ops.NO_HINT, "type": p["type"], "how": None, "plan": None, "command": cut["full_plan"], **cut})
        return replace(d, compact={**single, "how": "placement", "plan": None,
                                   "command": f"vgpumgr gpu compact {single['gpu']} --for {single['type']}", **cut})
    same = single is not None and (single["host"], single["gpu"]) == (p["host"], p["gpu"])
    if single is not None and not same and single["moves"] < len(p["moves"]):
        return replace(d, compact={**single, "how": "placement", "plan": None,
                                   "command": f"vgpumgr gpu compact {single['gpu']} --for {single['type']}", **cut})
    return replace(d, compact={**(single if same else {"free_gb": None}), **hint_of(p), **cut})


def hint_of(p: dict[str, Any]) -> dict[str, Any]:
    """`fleet place`'s `compact` entry for a plan."""
    return {"host": p["host"], "gpu": p["gpu"], "type": p["type"], "moves": len(p["moves"]), "start": p["start"],
            "vms": [m["vm"] for m in p["moves"]], "how": p["how"],
            "plan": [{k: m[k] for k in ("vm", "from", "to", "why")} for m in p["moves"]],
            "command": f"vgpumgr fleet compact --for {p['type']} --apply"}
