"""`vgpumgr gpu compact BDF --for TYPE [--apply]`: on a GPU in mixed-size mode, the fewest live migrations
that free a placement of TYPE.

For every start of TYPE the vGPUs in its way are the moves it needs; the start needing the fewest (then the
fewest GB moved) wins (`placement_ids.fewest_moves`, pure: `fleet place` uses it on what the hosts published).
Every VM to move needs a destination: the fleet's first choice for it (`fleet place --vm`, as `host drain`
asks). `--apply` migrates them one at a time (vgpumgr.ops.migrate) and stops at the first failure: the VMs
moved before it stay moved (each migration is whole or not at all), the failed one stays here, and the
`gpu.compact` audit event says what was applied and what failed. After the last move the GPU's slot map is read
again: the freed start must be creatable now (something else may have taken it meanwhile). Nothing is moved
when any VM of the plan has no destination.
"""

from __future__ import annotations

from typing import Any

from vgpumgr.errors import Conflict, NotFound, VgpuError, error_class
from vgpumgr.ops.context import Context
from vgpumgr.ops.slot_map import slot_map
from vgpumgr.placement.ids import fewest_moves

COMPACT = "gpu.compact"


def _vm(label: str) -> str | None:
    return label.rsplit(" of ", 1)[1] if " of " in label else None


def plan(svc: Context, gpu: str, type_name: str) -> dict[str, Any]:
    m = slot_map(svc, gpu)
    if m["mode"] != "mixed":
        raise Conflict(f"{m['gpu']} is in {m['mode'] or 'an unknown'} vGPU mode: compacting applies to mixed size",
                       hint=f"`vgpumgr gpu mode {m['gpu']} --mixed` (with no vGPU on it)")
    t = _type(m, type_name)
    out: dict[str, Any] = {"gpu": m["gpu"], "type": t["name"], "feasible": True, "start": None, "moves": [],
                           "applied": [], "failed": None, "creatable": None}
    if t["creatable"]:
        out["start"] = t["creatable"][0]
        out["creatable"] = True
        out["why"] = f"placement ID {t['creatable'][0]} is free already"
        return out
    best = fewest_moves(t["supported"], t["placement_size"],
                        [(v["placement_id"], v["size"], _vm(v["vgpu"])) for v in m["vgpus"]])
    if best is None:
        out.update(feasible=False, why="every start is held by a vGPU without a VM to migrate")
        return out
    _n, _gb, start, way = best
    labels = {(v["placement_id"], v["size"]): v["vgpu"] for v in m["vgpus"]}
    from vgpumgr.ops.drain import _fleet_choice

    for at, size, vm in way:
        reasons: dict[str, str] = {}
        dests = _fleet_choice(svc, vm, reasons) if vm else []
        out["moves"].append({"vm": vm, "vgpu": labels[(at, size)], "placement_id": at, "size": size,
                             "to": dests[0][0] if dests else None, "reasons": reasons})
    out["start"] = start
    out["feasible"] = all(mv["to"] for mv in out["moves"])
    out["why"] = (f"moving {len(way)} VM(s) frees placement ID {start}" if out["feasible"] else
                  f"moving {len(way)} VM(s) would free placement ID {start}, but the fleet has no destination for "
                  + ", ".join(mv["vm"] for mv in out["moves"] if not mv["to"]))
    return out


def _type(m: dict[str, Any], type_name: str) -> dict[str, Any]:
    low = type_name.lower()
    t = next((t for t in m["types"] if low in (t["name"].lower(), t["name"].split()[-1].lower(), t["type"])), None)
    if t is None:
        raise NotFound(f"no vGPU type '{type_name}' on {m['gpu']}", hint=f"`vgpumgr gpu slots {m['gpu']}` lists them")
    return t


def apply(svc: Context, p: dict[str, Any], actor: str | None = None) -> dict[str, Any]:
    """Run the plan's migrations one at a time, stopping at the first that fails; then read the slot map again.
    The plan comes back with `applied`, `failed` (None, or the VM, its destination and why) and `creatable`
    (the freed start is creatable now); `failure(p)` is the error to report when it is not done."""
    from vgpumgr.ops.migrate import migrate_vm

    if not p["feasible"] or not p["moves"]:
        return p
    for mv in p["moves"]:
        try:
            res = migrate_vm(svc, mv["vm"], mv["to"], actor=actor)
        except VgpuError as e:
            p["failed"] = {"vm": mv["vm"], "to": mv["to"], "error": e.message, "hint": e.hint, "kind": e.kind}
            break
        p["applied"].append({"vm": mv["vm"], "to": mv["to"], "migration": res["migration"]})
    if p["failed"] is None:
        svc.invalidate()
        m = slot_map(svc, p["gpu"])
        t = _type(m, p["type"])
        p["creatable"] = p["start"] in t["creatable"]
        if not p["creatable"]:
            p["taken_by"] = [v["vgpu"] for v in m["vgpus"]
                             if v["placement_id"] < p["start"] + t["placement_size"]
                             and p["start"] < v["placement_id"] + v["size"]]
    err = failure(p)
    with svc.tx() as s:
        svc.event(s, COMPACT, "ok" if err is None else "failed", actor=actor, gpu=p["gpu"],
                  error=err.message if err else None,
                  detail={k: p.get(k) for k in ("type", "start", "applied", "failed", "creatable")})
    return p


def failure(p: dict[str, Any]) -> VgpuError | None:
    """The error an applied plan ends with: the migration that failed (and what was moved before it), or the
    freed start taken by something else; None when the start is creatable now."""
    moved = ", ".join(f"{a['vm']} to {a['to']}" for a in p["applied"]) or "nothing"
    f = p.get("failed")
    if f:
        return _error_class(f["kind"])(
            f"compacting {p['gpu']} for {p['type']} stopped: migrating VM {f['vm']} to {f['to']} failed: "
            f"{f['error']}; already moved: {moved}",
            hint=(f"{f['hint']}; " if f.get("hint") else "") + f"VM {f['vm']} was not moved; run "
            f"`vgpumgr gpu compact {p['gpu']} --for {p['type'].split()[-1]}` again for a new plan")
    if p["applied"] and p.get("creatable") is False:
        return Conflict(f"compacting {p['gpu']} moved {moved}, but placement ID {p['start']} of {p['type']} is not "
                        f"creatable now: taken by {', '.join(p.get('taken_by') or []) or 'something else'}",
                        hint=f"`vgpumgr gpu slots {p['gpu']}` shows who holds it")
    return None


def _error_class(kind: str) -> type[VgpuError]:
    """The error class of that kind: a migration refused as a Conflict stops the compaction as one (exit 4)."""
    return error_class(kind)


def text(p: dict[str, Any]) -> str:
    lines = [f"{p['gpu']}: {p['type']}: {p['why']}"]
    for mv in p["moves"]:
        done = " [done]" if any(a["vm"] == mv["vm"] for a in p["applied"]) else (
            " [failed]" if (p.get("failed") or {}).get("vm") == mv["vm"] else "")
        lines.append(f"  move {mv['vm']} ({mv['vgpu']} at {mv['placement_id']}) -> {mv['to'] or 'no destination'}"
                     + done)
    if p["applied"] and p.get("creatable"):
        lines.append(f"placement ID {p['start']} of {p['type'].split()[-1]} is creatable now")
    return "\n".join(lines) + "\n"
