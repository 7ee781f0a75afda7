"""The fleet's use cases: publish this host now, list what the hosts published, and choose a host.

Reads are a few indexed queries over the published rows (vgpumgr.fleet.store); the choice is the pure
vgpumgr.fleet.place. Nothing here allocates: the chosen host's own service does, and its placement decides.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vgpumgr import ids
from vgpumgr.db.models import FleetGpu
from vgpumgr.errors import Busy, InvalidInput, NotFound
from vgpumgr.fleet import fragmented, ranked, store, writes
from vgpumgr.fleet import place as fleet_place
from vgpumgr.nvidia import compat
from vgpumgr.ops.context import Context

HEARTBEAT_LOCK_WAIT_S = 5.0
SHOW_GPUS_OF = 5  # ranked hosts whose GPUs a decision names (all a large fleet's decision ranks)
EVERY_HOST_UP_TO = 200  # a fleet this small gets a line per host in every decision
FIRST_BATCH = 16  # hosts of a large fleet read at first; twice as many each further round
# `pack` by best fit while at most this many hosts' tightest GPUs are behind (each is read from its own rows);
# more (a rolling upgrade, the hour after one) and `pack` keeps the previous order, free instances alone
FIT_BEHIND_UP_TO = 100
FRAGMENTED_GPUS = 64  # GPUs with the type's GB free a large fleet's fragmentation hint reads, the most room first
NVIDIA = "10de"


def publish(svc: Context, *, heartbeat: bool = False) -> dict[str, Any]:
    """Re-read this host and publish all of it (the heartbeat, `vgpumgr fleet publish`). Under the host lock, so
    no change of this host lands between the reading and the writing; when the lock stays taken (a long
    operation), only the heartbeat's time stamp is written."""
    try:
        with svc.locked(timeout=HEARTBEAT_LOCK_WAIT_S):
            svc.snapshot(refresh=True)
            with svc.tx() as s:
                n = svc.fleet.publish(s, full=True, heartbeat=heartbeat)
    except Busy:
        with svc.tx() as s:
            writes.beat(s, svc.host_id(s))
        return {"host": svc.hostname, "gpus_written": 0, "busy": True, "ms": 0.0}
    return {"host": svc.hostname, "gpus_written": n, "busy": False, "ms": round(svc.fleet.last_ms, 3)}


def _host_dict(h: store.HostRow) -> dict[str, Any]:
    return {"host": h.name, "endpoint": h.endpoint, "migration_uri": h.migration_uri,
            "driver_version": h.driver_version, "vgpumgr_version": h.version, "gpus": h.gpus, "vgpus": h.vgpus,
            "heartbeat_at": h.heartbeat_at, "heartbeat_age_s": round(h.age_s, 3),
            "heartbeat_s": h.heartbeat_s, "stale_after_s": h.stale_after_s, "stale": h.stale,
            "cordoned": h.cordoned, "cordon_reason": h.cordon_reason, "generation": h.generation}


def hosts(svc: Context) -> list[dict[str, Any]]:
    """Every host that published, with its heartbeat's age, whether it is stale, and its cordon."""
    with svc.reads() as s:
        return [_host_dict(h) for h in store.hosts(s)]


def _host_ids(s: Any, host: str | None) -> tuple[list[store.HostRow], list[int] | None]:
    rows = store.hosts(s)
    if host is None:
        return rows, None
    name = ids.host_name(host)
    found = [h for h in rows if h.name == name]
    if not found:
        raise NotFound(f"host {name} has published nothing",
                       hint="`vgpumgr fleet hosts` lists the hosts that did; a host publishes while `vgpumgr serve` "
                            "runs there")
    return found, [found[0].host_id]


def gpus(svc: Context, host: str | None = None, type_name: str | None = None) -> list[dict[str, Any]]:
    """The published GPUs (of one host), with their free instances of `type_name` when given."""
    with svc.reads() as s:
        rows, host_ids = _host_ids(s, host)
        names = {h.host_id: h for h in rows}
        offered = {(o.host_id, o.gpu): o for o in store.offers(s, type_name, host_ids)} if type_name else None
        out = []
        for g, types, open_types, _free in store.gpus(s, host_ids):
            h = names.get(g.host_id)
            if h is None or (offered is not None and (g.host_id, g.address) not in offered):
                continue
            d = {"host": h.name, "address": g.address, "model": g.model, "pci_id": f"{g.vendor_id}:{g.device_id}",
                 "subsystem_id": f"{g.subsystem_vendor_id}:{g.subsystem_device_id}" if g.subsystem_device_id
                 else None, "driver": g.driver, "driver_version": h.driver_version if g.vendor_id == NVIDIA else None,
                 "mode": g.mode, "numa_node": g.numa_node, "vgpus": g.vgpus, "types": types,
                 "types_free": open_types, "stale": h.stale, "cordoned": h.cordoned}
            if offered is not None:
                o = offered[(g.host_id, g.address)]
                d.update(type=o.name, free=o.free, used=o.used, max=o.max)
            out.append(d)
        return out


def capacity(svc: Context, type_name: str | None = None) -> dict[str, Any]:
    """Without a type: per type, the hosts and GPUs offering it and their free and used instances. With one:
    per host, its free and used instances of that type, and which hosts are stale or cordoned."""
    with svc.reads() as s:
        if type_name is None:
            return {"types": store.capacity_by_type(s)}
        per_host = store.capacity_by_host(s, type_name)
    out = [{"host": c.name, "gpus": c.gpus, "gpus_free": c.gpus_free, "free": c.free, "used": c.used, "max": c.max,
            "stale": c.stale, "cordoned": c.cordoned, "placeable": not (c.stale or c.cordoned) and c.free > 0}
           for c in per_host]
    out.sort(key=lambda r: r["host"])
    name = per_host[0].type_name if per_host else type_name
    return {"type": name, "hosts": out, "free": sum(r["free"] for r in out if not (r["stale"] or r["cordoned"])),
            "free_including_unplaceable": sum(r["free"] for r in out)}


def grid(svc: Context, type_name: str | None = None, state: str | None = None, page: int = 1,
         per_page: int = 50) -> dict[str, Any]:
    """The fleet page: hosts (filtered by state: ok, stale, cordoned) x their GPUs, each GPU with the types in use
    (used and free slots) and the wanted type's slots; one page of hosts at a time, chosen and counted in SQL."""
    if state not in (None, "ok", "stale", "cordoned"):
        raise InvalidInput(f"'{state}' is not a host state", hint="use ok, stale or cordoned")
    wanted = store.type_match(type_name) if type_name else None
    with svc.reads() as s:
        counts = ranked.page_counts(s)
        page = max(1, page)
        ids_, matching = ranked.page_hosts(s, wanted, state, (page - 1) * per_page, per_page)
        pages = max(1, -(-matching // per_page))
        if page > pages:  # past the last page: the last one
            page = pages
            ids_, matching = ranked.page_hosts(s, wanted, state, (page - 1) * per_page, per_page)
        shown = store.hosts(s, ids_)
        gpus_of: dict[int, list[dict[str, Any]]] = {}
        for g, types, open_types, _free in store.gpus(s, ids_):
            gpus_of.setdefault(g.host_id, []).append({
                "address": g.address, "model": g.model, "mode": g.mode, "numa_node": g.numa_node, "vgpus": g.vgpus,
                "types": types, "types_free": open_types, "slots": []})
        by_gpu = {(h, g["address"]): g for h, gs in gpus_of.items() for g in gs}
        for r in store.slot_rows(s, ids_, type_name):
            g = by_gpu.get((r.host_id, r.gpu))
            if g is not None:
                g["slots"].append({"type": r.short, "used": r.used, "free": r.free, "max": r.max,
                                   "wanted": r.short == wanted})
        placeable = ranked.placeable_free(s, wanted) if wanted else None
    hosts_out = [{**_host_dict(h), "state": _state(h), "gpu_list": gpus_of.get(h.host_id, [])} for h in shown]
    return {"hosts": hosts_out, "counts": counts, "page": page, "pages": pages, "type": wanted,
            "state": state, "placeable_free": placeable, "matching": matching}


def _state(h: store.HostRow) -> str:
    return "stale" if h.stale else "cordoned" if h.cordoned else "ok"


def place(svc: Context, request: fleet_place.FleetRequest, *, every_host: bool = False, hint: bool = True
          ) -> fleet_place.FleetDecision:
    """Which host should take `request`, and why every other host should not (`every_host`, or a fleet of at
    most EVERY_HOST_UP_TO hosts: a line per host; a larger one: its best hosts, and the others counted by
    reason, vgpumgr.fleet.ranked). When none can take one vGPU, `compact` names a fragmented mixed-size GPU
    (`hint`; vgpumgr.ops.fleet_compact.place adds the fleet's plan). Changes nothing."""
    with svc.reads() as s:
        total = ranked.host_count(s, up_to=EVERY_HOST_UP_TO)
        if not total:
            raise NotFound("no host has published its capacity yet",
                           hint="hosts publish while `vgpumgr serve` runs there with VGPUMGR_DB naming this database")
        best_fit = request.strategy != "pack" or ranked.fit_behind(s, FIT_BEHIND_UP_TO) <= FIT_BEHIND_UP_TO
        if every_host or total <= EVERY_HOST_UP_TO:
            rows = store.hosts(s)
            migrating = _migrating(s, request) if request.vm else None
            d = fleet_place.place(rows, store.offer_groups(s, request.type), request, migrating, best_fit)
            full = [(h.host_id, h.name) for h in rows if h.name in
                    {r.host for r in d.rejected if r.code == fleet_place.NO_CAPACITY}]
        else:
            d, rows = _place_ranked(s, request, best_fit)
            full = None
        first = {h.name: h.host_id for h in rows if any(c.host == h.name for c in d.ranked[:SHOW_GPUS_OF])}
        gpus = store.open_gpus(s, request.type, list(first.values()))
        single = None
        if d.choice is None and request.count == 1 and hint:
            if full is None:  # a large fleet: the GPUs with the most room first, read up to a bound
                rooms, names = fragmented.roomiest(s, store.type_match(request.type), FRAGMENTED_GPUS + 1)
                cut = len(rooms) > FRAGMENTED_GPUS
                single = _fragmented(s, request, rooms[:FRAGMENTED_GPUS], names, cut)
            else:
                single = _fragmented(s, request, fragmented.rooms(s, [h for h, _ in full]), dict(full), False)
    if single is not None:
        d = replace(d, compact=single)
    return fleet_place.with_gpus(d, gpus, {v: k for k, v in first.items()})


def _place_ranked(s: Any, request: fleet_place.FleetRequest, best_fit: bool
                  ) -> tuple[fleet_place.FleetDecision, list[store.HostRow]]:
    """A large fleet: the hosts walked in the placer's order until SHOW_GPUS_OF of them fit (and the irregular
    ones), ranked by the pure placer exactly as over every host; the rest counted."""
    from vgpumgr.ids import parse_type_name

    short = store.type_match(request.type)
    nvidia = parse_type_name(request.type) is not None
    migrating = _migrating(s, request) if request.vm else None
    board = driver = None
    if migrating and migrating.vgpus:
        v = migrating.vgpus[0]
        board, driver = v.device_id, v.host_driver
    rows = store.hosts(s, ranked.irregular(s, short, best_fit))
    apart = {h.host_id: h.name for h in rows}  # judged by the placer from their rows, every reason counted here
    groups = store.offer_groups(s, request.type, [h.host_id for h in rows])
    offset, limit, fits = 0, FIRST_BATCH, 0
    while fits < SHOW_GPUS_OF:
        ids_ = ranked.candidates(s, short, request.count, nvidia, request.strategy, offset, limit, board, driver,
                                 best_fit)
        batch = store.hosts(s, [i for i in ids_ if all(h.host_id != i for h in rows)])
        mine = store.offer_groups(s, request.type, [h.host_id for h in batch])
        fits += len(fleet_place.place(batch, mine, request, migrating, best_fit).ranked)
        rows += batch
        groups += mine
        if len(ids_) < limit:
            break
        offset, limit = offset + limit, limit * 2
    d = fleet_place.place(rows, groups, request, migrating, best_fit)
    c = ranked.counts(s, short, request.count, nvidia, list(apart))
    counted = {fleet_place.STALE: c.stale, fleet_place.CORDONED: c.cordoned,
               fleet_place.NOT_OFFERED: c.not_offered, fleet_place.NO_CAPACITY: c.no_capacity}
    for r in d.rejected:  # model-denied, incompatible, source: of the hosts walked (those with room)
        if r.host in apart.values() or r.code not in (fleet_place.STALE, fleet_place.CORDONED, fleet_place.NOT_OFFERED,
                                             fleet_place.NO_CAPACITY):
            counted[r.code] = counted.get(r.code, 0) + 1
    counted = {k: n for k, n in counted.items() if n}
    d = replace(d, ranked=d.ranked[:SHOW_GPUS_OF], considered=c.hosts, every_host=False, counted=counted,
                rejected=[r for r in d.rejected if r.code not in (fleet_place.STALE, fleet_place.CORDONED)])
    return d, rows


def _fragmented(s: Any, request: fleet_place.FleetRequest, rooms: list[fragmented.Room], names: dict[int, str],
                cut: bool) -> dict[str, Any] | None:
    """No host fits: of the GPUs with room on hosts without capacity, the one whose `gpu compact` frees a start
    with fewest moves. `cut`: more GPUs had room than were read; the hint says so (`cut_short`) and names `fleet
    compact --for`, which searches the whole fleet."""
    held = fragmented.vgpus(s, sorted({r.host_id for r in rooms}))  # only the hosts with GB to spare
    # the type's rows only of the GPUs it can judge (every vGPU's placement known)
    loads = fragmented.loads(s, request.type, [r for r in rooms if fragmented.judged(held.get((r.host_id, r.gpu)))])
    found = fragmented.suggest(request.type, loads, held, names)
    if not cut:
        return found
    return {**(found or NO_HINT), "type": store.type_match(request.type), **cut_short(request.type)}


NO_HINT = {"host": None, "gpu": None, "moves": None, "start": None, "vms": []}


def cut_short(type_name: str) -> dict[str, Any]:
    """What a hint bounded by what it reads says: the search was cut short, and the command that searches it all."""
    return {"cut_short": True, "full_plan": f"vgpumgr fleet compact --for {store.type_match(type_name)}"}


def _migrating(s: Any, request: fleet_place.FleetRequest) -> fleet_place.Migrating | None:
    """A VM whose vGPUs some host records is a VM to move: NVIDIA's rules then compare its GPUs' boards and its
    host's vGPU manager with each candidate's."""
    assert request.vm is not None
    found = store.vm_vgpus(s, request.vm)
    if not found:
        return None
    home = found[0].host
    mine = [v for v in found if v.host == home]
    if not any(compat.same_type(v.type_name or "", request.type) for v in mine):
        held = ", ".join(sorted({v.type_name or "?" for v in mine}))
        raise InvalidInput(f"VM {request.vm} on {home} has no {request.type} vGPU (it has {held})",
                           hint="a VM keeps its vGPU type when it migrates: ask for the type it has")
    source = next(iter(store.hosts(s, [mine[0].host_id])), None)
    boards = {g.address: g for g in s.query(FleetGpu).filter(FleetGpu.host_id == mine[0].host_id)}
    vgpus = tuple(compat.MigratingVgpu(v.type_name or request.type,
                                       device_id=boards[v.gpu].device_id if v.gpu in boards else None,
                                       gpu_name=boards[v.gpu].model if v.gpu in boards else None,
                                       host_driver=source.driver_version if source else None)
                  for v in mine if compat.same_type(v.type_name or "", request.type))
    return fleet_place.Migrating(request.vm, home, vgpus)
