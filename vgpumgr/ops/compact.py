"""`vgpumgr gpu compact BDF --for TYPE [--apply]`: on a GPU in mixed-size mode, the fewest live migrations
that free a placement of TYPE.

For every start of TYPE the vGPUs in its way are the moves it needs; the start needing the fewest (then the
fewest GB moved) wins. Every VM to move needs a destination: the fleet's first choice for it (`fleet place
--vm`, as `host drain` asks). `--apply` migrates them one at a time (vgpumgr.ops.migrate) and stops at the
first failure; nothing is moved when any VM of the plan has no destination.
"""

from __future__ import annotations

from typing import Any

from vgpumgr.errors import Conflict, NotFound
from vgpumgr.ops.context import Context
from vgpumgr.ops.slot_map import slot_map

COMPACT = "gpu.compact"


def _vm(label: str) -> str | None:
    return label.rsplit(" of ", 1)[1] if " of " in label else None


def plan(svc: Context, gpu: str, type_name: str) -> dict[str, Any]:
    m = slot_map(svc, gpu)
    if m["mode"] != "mixed":
        raise Conflict(f"{m['gpu']} is in {m['mode'] or 'an unknown'} vGPU mode: compacting applies to mixed size",
                       hint=f"`vgpumgr gpu mode {m['gpu']} --mixed` (with no vGPU on it)")
    low = type_name.lower()
    t = next((t for t in m["types"] if low in (t["name"].lower(), t["name"].split()[-1].lower(), t["type"])), None)
    if t is None:
        raise NotFound(f"no vGPU type '{type_name}' on {m['gpu']}", hint=f"`vgpumgr gpu slots {m['gpu']}` lists them")
    out: dict[str, Any] = {"gpu": m["gpu"], "type": t["name"], "feasible": True, "start": None, "moves": [],
                           "applied": []}
    if t["creatable"]:
        out["start"] = t["creatable"][0]
        out["why"] = f"placement ID {t['creatable'][0]} is free already"
        return out
    options = []
    for s in t["supported"]:
        end = s + t["placement_size"]
        way = [v for v in m["vgpus"] if v["placement_id"] < end and s < v["placement_id"] + v["size"]]
        if any(_vm(v["vgpu"]) is None for v in way):
            continue  # a vGPU without a VM cannot be migrated
        options.append((len(way), sum(v["size"] for v in way), s, way))
    if not options:
        out.update(feasible=False, why="every start is held by a vGPU without a VM to migrate")
        return out
    _n, _gb, start, way = min(options, key=lambda o: o[:3])
    from vgpumgr.ops.drain import _fleet_choice

    for v in way:
        vm = _vm(v["vgpu"])
        reasons: dict[str, str] = {}
        dests = _fleet_choice(svc, vm, reasons) if vm else []
        out["moves"].append({"vm": vm, "vgpu": v["vgpu"], "placement_id": v["placement_id"], "size": v["size"],
                             "to": dests[0][0] if dests else None, "reasons": reasons})
    out["start"] = start
    out["feasible"] = all(mv["to"] for mv in out["moves"])
    out["why"] = (f"moving {len(way)} VM(s) frees placement ID {start}" if out["feasible"] else
                  f"moving {len(way)} VM(s) would free placement ID {start}, but the fleet has no destination for "
                  + ", ".join(mv["vm"] for mv in out["moves"] if not mv["to"]))
    return out


def apply(svc: Context, p: dict[str, Any], actor: str | None = None) -> dict[str, Any]:
    from vgpumgr.ops.migrate import migrate_vm

    if not p["feasible"]:
        return p
    for mv in p["moves"]:
        res = migrate_vm(svc, mv["vm"], mv["to"], actor=actor)
        p["applied"].append({"vm": mv["vm"], "to": mv["to"], "migration": res["migration"]})
    with svc.tx() as s:
        svc.event(s, COMPACT, actor=actor, gpu=p["gpu"], detail={k: p[k] for k in ("type", "start", "applied")})
    return p


def text(p: dict[str, Any]) -> str:
    lines = [f"{p['gpu']}: {p['type']}: {p['why']}"]
    for mv in p["moves"]:
        lines.append(f"  move {mv['vm']} ({mv['vgpu']} at {mv['placement_id']}) -> {mv['to'] or 'no destination'}"
                     + (" [done]" if any(a["vm"] == mv["vm"] for a in p["applied"]) else ""))
    return "\n".join(lines) + "\n"
