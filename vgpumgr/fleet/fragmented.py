"""`fleet place`'s hint when no host can take a type: a GPU in NVIDIA's mixed-size mode with the GB free for it
whose starts are only fragmented, and the fewest moves `vgpumgr gpu compact` there would need, across the fleet.

Computed from what the hosts share: each GPU's published room (its row's region and GB in use, migration 0017),
the wanted type's row of the GPUs it can judge, and the live allocations' placement IDs as vgpumgr chose them (in
mixed-size mode only; in equal-size mode a record holds at most the driver's own, marked as such). A GPU any of
whose vGPUs has no chosen placement ID is not judged. It only names where to look: that host's own `gpu compact`
plans the moves and finds their destinations.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from sqlalchemy import ARRAY, Integer, any_, bindparam, select, text, tuple_
from sqlalchemy.orm import Session

from vgpumgr import ids
from vgpumgr.db.models import LIVE_STATES, Allocation, FleetCapacity, FleetGpu, Vm
from vgpumgr.fleet.ranked import _FRESH, _UNCORDONED
from vgpumgr.fleet.store import type_match
from vgpumgr.placement import ids as pid


class GpuLoad(NamedTuple):
    """One published GPU offering the wanted type."""

    host_id: int
    gpu: str
    region_mb: int | None  # its largest type's framebuffer: the whole GPU
    used_mb: int  # framebuffer of the vGPUs on it
    free: int  # free instances of the wanted type
    max: int | None  # the wanted type's equal-size maximum
    name: str  # the wanted type's name on that GPU
    framebuffer_mb: int | None  # the wanted type's


# a GPU whose room (fleet_gpus.region_mb, used_mb) a previous release's publish left behind (migration 0017)
UNROOMED = "(g.room_at IS NULL OR g.room_at <> g.published_at)"


class Room(NamedTuple):
    host_id: int
    gpu: str
    region_mb: int | None
    used_mb: int


def among(s: Session, column: Any, ids: Sequence[int]) -> Any:
    """`column IN ids`: one array on PostgreSQL (a thousand bound values cost more to send and plan than the
    read itself), expanded on SQLite."""
    if s.get_bind().dialect.name == "postgresql":
        return column == any_(bindparam("among", list(ids), type_=ARRAY(Integer)))
    return column.in_(list(ids))


def behind_hosts(s: Session) -> list[int]:
    """Hosts with a GPU whose room a previous release left behind (ix_fleet_gpus_unroomed; empty once every host
    runs this release)."""
    return [h for (h,) in s.execute(text(f"SELECT DISTINCT g.host_id FROM fleet_gpus g WHERE {UNROOMED}"))]


def rooms(s: Session, host_ids: Sequence[int], least_mb: int = 0) -> list[Room]:
    """The hosts' GPUs holding vGPUs with at least `least_mb` free: from the room each GPU's row publishes,
    through its index (summing each GPU's type rows, as this did, took about 170 ms at 10,000 hosts); a GPU
    whose room a previous release left behind is summed from its own rows."""
    if not host_ids:
        return []
    g = FleetGpu.__table__.alias("g")
    published = (select(g.c.host_id, g.c.address, g.c.region_mb, g.c.used_mb)
                 .where(among(s, g.c.host_id, host_ids), text("g.vgpus > 0"),  # the indexes' own words
                        g.c.region_mb - g.c.used_mb >= least_mb, text(f"NOT {UNROOMED}")))
    out = [Room(*r) for r in s.execute(published)]
    wanted = set(host_ids)
    behind = [h for h in behind_hosts(s) if h in wanted]
    if behind:
        summed = text(
            "SELECT x.host_id, x.gpu, max(x.framebuffer_mb), sum(x.used * coalesce(x.framebuffer_mb, 0)) "
            "FROM fleet_gpus g JOIN fleet_capacity x ON x.host_id = g.host_id AND x.gpu = g.address "
            f"WHERE g.host_id IN :ids AND {UNROOMED} AND g.vgpus > 0 GROUP BY x.host_id, x.gpu "
            "HAVING max(x.framebuffer_mb) - sum(x.used * coalesce(x.framebuffer_mb, 0)) >= :least"
        ).bindparams(bindparam("ids", expanding=True))
        out += [Room(r[0], r[1], r[2], int(r[3] or 0)) for r in s.execute(summed, {"ids": behind, "least": least_mb})]
    return sorted(out)


_ROOM = "(g.region_mb - g.used_mb)"  # ix_fleet_gpus_room's own expression
_ROOMY = f"g.vgpus > 0 AND {_ROOM} >= coalesce(t.framebuffer_mb, 0) AND NOT {UNROOMED} AND {{where}}"
# PostgreSQL: the host's type row, freshness and cordon looked up for each GPU as the room index is walked (the
# OFFSET keeps the planner from joining every offering host first: 190 ms at 10,000 hosts, against 7)
_ROOMIEST = {
    "postgresql": (
        "SELECT g.host_id, g.address, g.region_mb, g.used_mb, t.host FROM fleet_gpus g CROSS JOIN LATERAL (SELECT "
        "t.host FROM fleet_host_types t JOIN fleet_hosts h ON h.host_id = t.host_id WHERE t.host_id = g.host_id AND "
        f"t.short = :short AND {_ROOMY.replace('g.vgpus > 0 AND ', '')} OFFSET 0) t WHERE g.vgpus > 0 "
        f"ORDER BY {_ROOM} DESC LIMIT {{limit}}"),
    "sqlite": (
        "SELECT g.host_id, g.address, g.region_mb, g.used_mb, t.host FROM fleet_gpus g JOIN fleet_host_types t ON "
        "t.host_id = g.host_id AND t.short = :short JOIN fleet_hosts h ON h.host_id = g.host_id WHERE "
        f"{_ROOMY} ORDER BY {_ROOM} DESC, g.host_id, g.address LIMIT {{limit}}")}


def roomiest(s: Session, short: str, limit: int) -> tuple[list[Room], dict[int, str]]:
    """A large fleet's GPUs the hint reads: holding vGPUs on fresh, uncordoned hosts offering the type with no free
    instance of it, with the type's GB free (by the host's smallest framebuffer of it), the most room first, at
    most `limit`: one walk down the room index (ix_fleet_gpus_room) joined to each host's type row, not a list of
    every host without room first. Their host names too; a GPU whose room a previous release left behind is
    summed from its own rows (`rooms`)."""
    d = s.get_bind().dialect.name
    where = f"t.free = 0 AND {_FRESH[d]} AND {_UNCORDONED}"
    rows = s.execute(text(_ROOMIEST[d].format(where=where, limit=int(limit))), {"short": short}).all()
    out = sorted((Room(r[0], r[1], r[2], int(r[3] or 0)) for r in rows), key=lambda r: (-r.region_mb + r.used_mb, r))
    names = {r[0]: r[4] for r in rows}
    behind = behind_hosts(s)
    if behind:  # empty once every host runs this release
        sql = text(f"SELECT t.host_id, t.host, t.framebuffer_mb FROM fleet_host_types t JOIN fleet_hosts h ON "
                   f"h.host_id = t.host_id WHERE t.short = :short AND t.host_id IN :ids AND {where}"
                   ).bindparams(bindparam("ids", expanding=True))
        seen = {(r.host_id, r.gpu) for r in out}
        for host_id, name, fb in s.execute(sql, {"short": short, "ids": behind}):
            out += [r for r in rooms(s, [host_id], fb or 0) if (r.host_id, r.gpu) not in seen]
            names[host_id] = name
    return out[:limit], names


def loads(s: Session, wanted: str, gpus: Sequence[Room]) -> list[GpuLoad]:
    """Those GPUs with the wanted type's row (each found from ix_fleet_capacity_short_gpu), no free instance of
    it and its GB free (`roomy`, the only ones `suggest` can judge)."""
    if not gpus:
        return []
    room = {(r.host_id, r.gpu): r for r in gpus}
    q = (select(FleetCapacity.host_id, FleetCapacity.gpu, FleetCapacity.free, FleetCapacity.max, FleetCapacity.name,
                FleetCapacity.framebuffer_mb)
         .where(FleetCapacity.short == type_match(wanted), FleetCapacity.free == 0,
                tuple_(FleetCapacity.host_id, FleetCapacity.gpu).in_(list(room))))
    found = [GpuLoad(h, gpu, room[h, gpu].region_mb, room[h, gpu].used_mb, int(free or 0), mx, name, fb)
             for h, gpu, free, mx, name, fb in s.execute(q)]
    return sorted(g for g in found if roomy(g))


def judged(mine: Sequence[Held] | None) -> bool:
    """Every vGPU on the GPU has the placement ID vgpumgr chose and a known framebuffer: `suggest` can judge it."""
    return bool(mine) and all(p is not None and fb is not None for p, fb, _vm in mine or ())


def roomy(g: GpuLoad) -> bool:
    """No free instance of the wanted type, yet the GB for one: worth reading its vGPUs' placements."""
    return (g.free == 0 and bool(g.region_mb and g.framebuffer_mb)
            and g.region_mb - g.used_mb >= (g.framebuffer_mb or 0))


Held = tuple[int | None, int | None, str | None]  # a vGPU's placement ID, framebuffer MB and VM


def chosen_start(detail: Mapping[str, Any]) -> int | None:
    """The placement ID vgpumgr chose for a vGPU (mixed-size mode); None for one the driver gave in equal-size
    mode (Ada+/R570+), which says nothing of a mixed-size layout."""
    return None if detail.get("placement_by") == "driver" else detail.get("placement_id")


def vgpus(s: Session, host_ids: Sequence[int]) -> dict[tuple[int, str], list[Held]]:
    """(host id, GPU) -> its live vGPUs as (placement ID or None, framebuffer MB, VM name or None)."""
    if not host_ids:
        return {}
    q = (select(Allocation.host_id, Allocation.type_name, Allocation.detail, Vm.name)
         .outerjoin(Vm, Vm.id == Allocation.vm_id)
         .where(among(s, Allocation.host_id, host_ids), Allocation.state.in_(LIVE_STATES)))
    out: dict[tuple[int, str], list[Held]] = {}
    for host_id, type_name, detail, vm in s.execute(q):
        d = detail or {}
        if not d.get("gpu"):
            continue
        fb = framebuffer_mb(d, type_name)
        out.setdefault((host_id, d["gpu"]), []).append((chosen_start(d), fb, vm))
    return out


def framebuffer_mb(detail: Mapping[str, Any], type_name: str | None) -> int | None:
    """A live vGPU's framebuffer: as its record says, else from its type's name (None when neither tells)."""
    fb = detail.get("framebuffer_mb")
    if fb is None:
        parsed = ids.parse_type_name(type_name or "")
        fb = int(parsed.framebuffer_gb * 1024) if parsed else None
    return fb


def suggest(type_name: str, gpus: Iterable[GpuLoad], held: Mapping[tuple[int, str], Sequence[Any]],
            host_names: Mapping[int, str]) -> dict[str, Any] | None:
    """Pure: the GPU with room in GB for `type_name` but no free start whose `gpu compact` needs the fewest moves
    (then the fewest GB moved, then host and GPU by name); None when no GPU is only fragmented."""
    from vgpumgr.placement.mixed import _arch

    best: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    for g in gpus:
        mine = held.get((g.host_id, g.gpu)) or []
        if g.free > 0 or not g.region_mb or not g.framebuffer_mb or not mine:
            continue
        if any(p is None or fb is None for p, fb, _vm in mine):
            continue  # equal-size mode, or a vGPU whose place is not known: not judged
        region, size_gb = g.region_mb // 1024, max(g.framebuffer_mb // 1024, 1)
        arch = _arch(g.name)
        size = pid.placement_size(region, size_gb, arch)
        taken = [(int(p), pid.placement_size(region, max(fb // 1024, 1), arch), vm) for p, fb, vm in mine]
        if region - sum(t[1] for t in taken) < size:
            continue  # full, not fragmented
        found = pid.fewest_moves(pid.supported(region, size_gb, g.max, arch), size, taken)
        if found is None or found[0] == 0:
            continue  # a start is free: something else (no free VF) keeps the type out
        moves, gb, start, way = found
        host = host_names.get(g.host_id, "?")
        key = (moves, gb, host, g.gpu)
        if best is None or key < best[0]:
            best = key, {"host": host, "gpu": g.gpu, "type": type_match(type_name), "moves": moves, "start": start,
                         "vms": [vm for _p, _s, vm in way], "free_gb": region - sum(t[1] for t in taken)}
    return best[1] if best else None


def hint(c: Mapping[str, Any]) -> str:
    cut = (f"the fleet's plan search was cut short: `{c['full_plan']}` gives the full plan"
           if c.get("cut_short") else "")
    if c.get("host") is None:
        return cut or "no GPU can be freed"
    n = c["moves"]
    vms = f"{n} VM{'s' if n != 1 else ''}"
    if c.get("how") in (None, "placement") and c.get("start") is not None:
        text = (f"{c['gpu']} on {c['host']} is fragmented: `vgpumgr gpu compact {c['gpu']} --for {c['type']}` "
                f"(on {c['host']}) frees a start by moving {vms}")
    else:
        text = f"{c['gpu']} on {c['host']} is taken by {vms} of other sizes"
    if c.get("plan") and c.get("how") != "placement":
        moves = ", ".join(f"{m['vm']} to {m['to']}" for m in c["plan"])
        text += f": `vgpumgr fleet compact --for {c['type']} --apply` (on {c['host']}) moves {moves}"
    return f"{text}; {cut}" if cut else text
