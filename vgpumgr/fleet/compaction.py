"""Making room for a vGPU type across the fleet: which GPU to free, and which VMs must leave it.

From what the hosts share (their published rows and the live allocations' records), for every GPU of a fresh,
uncordoned host that offers the type but has no free instance of it, the VMs that must move off it:
- a GPU in mixed-size mode whose vGPUs all have the placement ID vgpumgr chose: for every start of the type that
  at most --max-moves migrations free, the VMs in its way (`placement.ids.every_start`): not only the start
  needing the fewest (as `gpu compact`), whose VMs may have nowhere to go while another start's do;
- any other GPU (equal-size mode holding a stray vGPU of another size, MIG mode, a placement not known): all of
  its VMs, which leaves it empty, and an empty GPU of its model takes the type (its published maximum is > 0).
A vGPU without a VM, or whose VM does not run (its allocation is not active), cannot be moved by a live
migration: a GPU needing such a move is not a candidate. The options come back fewest moves first (then fewest
GB moved, then host and GPU by name); vgpumgr.ops.fleet_compact finds each VM a destination.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import bindparam, select, text
from sqlalchemy.orm import Session

from vgpumgr.db.models import ALLOC_ACTIVE, LIVE_STATES, Allocation, Vm
from vgpumgr.fleet.fragmented import UNROOMED, among, chosen_start, framebuffer_mb
from vgpumgr.fleet.ranked import _FRESH, _UNCORDONED
from vgpumgr.placement import ids as pid

PLACEMENT, EMPTY = "placement", "empty-gpu"
CANDIDATES = 200  # GPUs without room read per plan, fewest vGPUs first


class FullGpu(NamedTuple):
    host_id: int
    host: str
    gpu: str
    name: str  # the wanted type's name on it
    framebuffer_mb: int | None  # the wanted type's
    region_mb: int | None  # its largest type's framebuffer: the whole GPU
    max: int | None  # the wanted type's equal-size maximum
    mode: str
    vgpus: int


class Held(NamedTuple):
    vm: str | None
    type_name: str
    active: bool  # runs (a live migration can move it)
    start: int | None  # the placement ID vgpumgr chose (mixed-size mode)
    framebuffer_mb: int | None


class Option(NamedTuple):
    moves: int
    gb: int
    host: str
    gpu: str
    how: str  # PLACEMENT | EMPTY
    start: int | None
    vms: tuple[str, ...]  # in the order to move them
    host_id: int
    type_name: str


def full_gpus(s: Session, short: str, limit: int = CANDIDATES) -> list[FullGpu]:
    """GPUs of fresh, uncordoned hosts offering the type with none free, holding vGPUs, fewest first (then by
    host id and address): walked in that order from their index (ix_fleet_gpus_held), each GPU's row of the type
    looked up (ix_fleet_capacity_short_gpu), until `limit` are found; the whole GPU is the framebuffer its row
    publishes (summed from its own rows where a previous release left that behind)."""
    d = s.get_bind().dialect.name
    room = (f"CASE WHEN {UNROOMED} THEN (SELECT max(y.framebuffer_mb) FROM fleet_capacity y WHERE y.host_id = "
            "g.host_id AND y.gpu = g.address) ELSE g.region_mb END")
    where = f"c.short = :short AND c.free = 0 AND coalesce(c.max, 0) > 0 AND {_FRESH[d]} AND {_UNCORDONED}"
    # The limit is written into the statement, not bound: against a bound LIMIT PostgreSQL's generic plan costs a
    # tenth of the rows, so it planned every call afresh. On PostgreSQL each GPU's row, host and cordon are looked
    # up in a lateral subquery (OFFSET 0: not flattened): planned as one five-table join it took 4-7 ms to plan
    # at 10,000 hosts, for 1 ms of work.
    if d == "postgresql":
        sql = text(
            f"SELECT g.host_id, x.host, g.address, x.name, x.framebuffer_mb, {room}, x.max, g.mode, g.vgpus "
            "FROM fleet_gpus g CROSS JOIN LATERAL (SELECT n.name AS host, c.name, c.framebuffer_mb, c.max FROM "
            "fleet_capacity c JOIN fleet_hosts h ON h.host_id = c.host_id JOIN hosts n ON n.id = c.host_id "
            f"WHERE c.host_id = g.host_id AND c.gpu = g.address AND {where} OFFSET 0) x WHERE g.vgpus > 0 "
            f"ORDER BY g.vgpus, g.host_id, g.address LIMIT {int(limit)}")
    else:
        sql = text(
            f"SELECT g.host_id, n.name, g.address, c.name, c.framebuffer_mb, {room}, c.max, g.mode, g.vgpus "
            "FROM fleet_gpus g JOIN fleet_capacity c ON c.host_id = g.host_id AND c.gpu = g.address "
            "JOIN fleet_hosts h ON h.host_id = g.host_id JOIN hosts n ON n.id = g.host_id "
            f"WHERE g.vgpus > 0 AND {where} ORDER BY g.vgpus, g.host_id, g.address LIMIT {int(limit)}")
    return [FullGpu(*r) for r in s.execute(sql, {"short": short})]


def held(s: Session, host_ids: Sequence[int]) -> dict[tuple[int, str], list[Held]]:
    """(host id, GPU) -> its live vGPUs."""
    if not host_ids:
        return {}
    q = (select(Allocation.host_id, Allocation.type_name, Allocation.state, Allocation.detail, Vm.name)
         .outerjoin(Vm, Vm.id == Allocation.vm_id)
         .where(among(s, Allocation.host_id, host_ids), Allocation.state.in_(LIVE_STATES)))
    out: dict[tuple[int, str], list[Held]] = {}
    for host_id, type_name, state, detail, vm in s.execute(q):
        d = detail or {}
        if not d.get("gpu"):
            continue
        fb = framebuffer_mb(d, type_name)
        out.setdefault((host_id, d["gpu"]), []).append(
            Held(vm, type_name or "", state == ALLOC_ACTIVE, chosen_start(d), fb))
    return out


def vm_counts(s: Session, host_id: int, vms: Sequence[str]) -> dict[str, dict[str, int]]:
    """VM -> its live vGPUs on the host by type (a VM moves with all of them)."""
    if not vms:
        return {}
    sql = text("SELECT v.name, a.type_name, count(*) FROM allocations a JOIN vms v ON v.id = a.vm_id "
               "WHERE a.host_id = :h AND v.name IN :vms AND a.state IN :live GROUP BY v.name, a.type_name"
               ).bindparams(bindparam("vms", expanding=True), bindparam("live", expanding=True))
    out: dict[str, dict[str, int]] = {}
    for vm, type_name, n in s.execute(sql, {"h": host_id, "vms": list(vms), "live": list(LIVE_STATES)}):
        out.setdefault(vm, {})[type_name or ""] = int(n)
    return out


def options(gpus: Sequence[FullGpu], held_by: dict[tuple[int, str], list[Held]], max_moves: int | None
            ) -> list[Option]:
    """Pure: for each GPU, each way to make room for the type (every start of it that at most `max_moves`
    migrations free, or emptying the GPU), with the VMs that must leave; fewest moves first."""
    from vgpumgr.placement.mixed import _arch

    out = []
    for g in gpus:
        mine = held_by.get((g.host_id, g.gpu)) or []
        if not mine or not g.framebuffer_mb:
            continue
        found = _placements(g, mine, _arch(g.name)) if all(h.start is not None for h in mine) else None
        ways = [(PLACEMENT, start, way) for start, way in found] if found is not None else [(EMPTY, None, list(mine))]
        for how, start, way in ways:
            if not way or any(h.vm is None or not h.active for h in way):
                continue  # a start or a GPU that only moves that cannot be made free
            vms = tuple(dict.fromkeys(h.vm for h in way if h.vm))
            if max_moves is not None and len(vms) > max_moves:
                continue
            gb = sum((h.framebuffer_mb or 0) for h in way) // 1024
            out.append(Option(len(vms), gb, g.host, g.gpu, how, start, vms, g.host_id, g.name))
    return sorted(out, key=lambda o: (o.moves, o.gb, o.host, o.gpu, o.start or 0))


def _placements(g: FullGpu, mine: list[Held], arch: str) -> list[tuple[int, list[Held]]] | None:
    """A mixed-size GPU: each start of the type that migrations can free, with the vGPUs in its way, fewest
    first; None when no start can be. The GPU need not have the type's GB free now: the moves free them (a
    GPU too full for the type only by what sits in one start's way is as good a candidate as a fragmented one)."""
    if not g.region_mb:
        return None
    region, size_gb = g.region_mb // 1024, max((g.framebuffer_mb or 0) // 1024, 1)
    size = pid.placement_size(region, size_gb, arch)
    taken = [(int(h.start), pid.placement_size(region, max((h.framebuffer_mb or 1024) // 1024, 1), arch),
              str(i)) for i, h in enumerate(mine) if h.start is not None]
    found = pid.every_start(pid.supported(region, size_gb, g.max, arch), size,
                            [(at, sz, tag if mine[int(tag)].vm and mine[int(tag)].active else None)
                             for at, sz, tag in taken])
    if not found:
        return None
    # --max-moves counts VMs, not vGPUs (a VM holding two in the way moves once): `options` applies it
    return [(start, [mine[int(tag)] for _at, _sz, tag in way if tag is not None]) for _n, _gb, start, way in found]
