"""Choosing a host for a vGPU from what the hosts published: a pure function, like vgpumgr.placement.placer.place.

`place(hosts, offers, request, migrating)` ranks the hosts that can take `request.count` vGPUs of the type now and
says for every other host why not: stale (its heartbeat is older than its own window), cordoned, the migrating
VM's own host, offers no such type, model denied by the policy, incompatible with the migrating VM (another
board or another vGPU manager version: NVIDIA's rules in vgpumgr.nvidia.compat), or no capacity. It decides only: the
chosen host's own service allocates, and its placement is the final word (two placers that chose the same last
slot are told apart there, not here).

NVIDIA gives a VM at most one vGPU of a physical GPU, so `count` vGPUs of an NVIDIA type need `count` GPUs with
a free instance on one host; other types need `count` free instances. `pack` fills GPUs up by best fit: the
host whose fullest GPU with a free instance of the type has the least framebuffer left (in mixed-size traces of
scripts/bench_fleet_density.py it accepted 4-6.5 % more VMs than the fewest free instances, its tie-break);
`spread` prefers the host with the most free instances; then the host name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple

from vgpumgr.errors import InvalidInput
from vgpumgr.fleet.store import GpuOffer, HostRow, OfferGroup
from vgpumgr.ids import parse_type_name, vm_name
from vgpumgr.nvidia import compat
from vgpumgr.placement.placer import STRATEGIES, requested_type

STALE, CORDONED, SOURCE, NOT_OFFERED, MODEL_DENIED, INCOMPATIBLE, NO_CAPACITY = (
    "stale", "cordoned", "source", "not-offered", "model-denied", "incompatible", "no-capacity")
MAX_COUNT = 16


@dataclass(frozen=True)
class FleetRequest:
    type: str
    vm: str | None = None
    count: int = 1
    strategy: str = "pack"
    allow_models: tuple[str, ...] = ()
    deny_models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", requested_type(self.type))
        if self.vm is not None:
            object.__setattr__(self, "vm", vm_name(self.vm))
        if not isinstance(self.count, int) or not 1 <= self.count <= MAX_COUNT:
            raise InvalidInput(f"count {self.count} is out of range",
                               hint=f"ask for 1 to {MAX_COUNT} vGPUs of one VM")
        if self.strategy not in STRATEGIES:
            raise InvalidInput(f"unknown placement policy '{self.strategy}'",
                               hint="use pack (fill hosts up first) or spread (the emptiest host first)")
        for m in (*self.allow_models, *self.deny_models):
            if not m.strip() or len(m) > 64:
                raise InvalidInput(f"'{m[:64]}' is not a model name", hint="use a model such as L40S or T4")


@dataclass(frozen=True)
class Migrating:
    """The VM being moved: the host its vGPUs are on, and what NVIDIA's rules compare of them."""

    vm: str
    host: str
    vgpus: tuple[compat.MigratingVgpu, ...]


class HostChoice(NamedTuple):  # tuples: a decision over a thousand hosts makes a thousand of these
    host: str
    endpoint: str | None
    migration_uri: str | None
    gpus: tuple[str, ...]  # where the count would go, in the policy's order (for the first ranked hosts)
    free: int  # free instances of the type on the host
    free_gpus: int  # its GPUs with a free instance
    why: str
    tightest_mb: int | None = None  # framebuffer left on the fullest of those GPUs (None: not known)


class HostRejection(NamedTuple):
    host: str
    code: str  # STALE, CORDONED, ...
    reason: str


@dataclass(frozen=True)
class FleetDecision:
    choice: HostChoice | None
    ranked: list[HostChoice]
    rejected: list[HostRejection]
    considered: int
    request: FleetRequest
    migrating: Migrating | None = None
    boards: dict[str, frozenset[tuple[str, str]]] = field(default_factory=dict)  # host -> usable (model, board)
    compact: dict[str, Any] | None = None  # no host fits: a fragmented GPU `gpu compact` frees a start on
    # False in a large fleet: `ranked` holds the first hosts, `rejected` those read and refused on the way, and
    # `rejected_counts` counts every host by its reason (vgpumgr.fleet.ranked)
    every_host: bool = True
    counted: dict[str, int] | None = None

    @property
    def rejected_counts(self) -> dict[str, int]:
        if self.counted is not None:
            return self.counted
        out: dict[str, int] = {}
        for r in self.rejected:
            out[r.code] = out.get(r.code, 0) + 1
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"choice": _json(self.choice) if self.choice else None,
                "ranked": [_json(c) for c in self.ranked], "rejected": [r._asdict() for r in self.rejected],
                "considered": self.considered, "request": asdict(self.request),
                "migrating": ({"vm": self.migrating.vm, "from": self.migrating.host} if self.migrating else None),
                "compact": self.compact, "every_host": self.every_host, "rejected_counts": self.rejected_counts}

    def summary(self) -> str:
        if not self.every_host:
            counts = ", ".join(f"{n} {code}" for code, n in sorted(self.rejected_counts.items()) if n)
            return f"of {self.considered} hosts: {counts or 'none refused'}"
        return "; ".join(f"{r.host}: {r.reason}" for r in self.rejected) or "no host has published anything"


def place(hosts: Sequence[HostRow], offers: Sequence[OfferGroup], request: FleetRequest,
          migrating: Migrating | None = None, best_fit: bool = True) -> FleetDecision:
    """Rank the hosts from their published rows (`offers`: one type's rows grouped per host and board). The
    GPUs each ranked host would use are filled in by `with_gpus` from that host's own rows. `best_fit` False:
    `pack` by free instances alone (the previous release's order, while many hosts run it)."""
    by_host: dict[int, list[OfferGroup]] = {}
    for o in offers:
        by_host.setdefault(o.host_id, []).append(o)
    nvidia = parse_type_name(request.type) is not None
    fits: list[tuple[tuple[Any, ...], HostChoice]] = []
    rejected: list[HostRejection] = []
    boards: dict[str, frozenset[tuple[str, str]]] = {}
    for h in sorted(hosts, key=lambda h: h.name):
        result = _evaluate(h, by_host.get(h.host_id, []), request, migrating, nvidia, best_fit)
        if isinstance(result, HostRejection):
            rejected.append(result)
        else:
            key, choice, usable = result
            fits.append((key, choice))
            boards[h.name] = usable
    fits.sort(key=lambda f: f[0])
    ranked = [c for _, c in fits]
    return FleetDecision(ranked[0] if ranked else None, ranked, rejected, len(hosts), request, migrating, boards)


def with_gpus(d: FleetDecision, rows: Sequence[GpuOffer], host_names: dict[int, str]) -> FleetDecision:
    """The decision with, for each ranked host whose rows are given, the GPUs its vGPUs would go to."""
    nvidia = parse_type_name(d.request.type) is not None
    by_host: dict[str, list[GpuOffer]] = {}
    for r in rows:
        by_host.setdefault(host_names.get(r.host_id, ""), []).append(r)
    pack = d.request.strategy == "pack"
    ranked = []
    for c in d.ranked:
        mine = [r for r in by_host.get(c.host, []) if (r.model, r.device_id) in d.boards.get(c.host, ())]
        if mine:
            order = sorted(mine, key=lambda r: (_room(r.room_mb), r.free, r.gpu) if pack else (-r.free, r.gpu))
            gpus = tuple(r.gpu for r in order[:d.request.count]) if nvidia else _by_instances(order, d.request.count)
            c = c._replace(gpus=gpus)
        ranked.append(c)
    return replace(d, choice=ranked[0] if ranked else None, ranked=ranked)


def _evaluate(h: HostRow, offers: list[OfferGroup], req: FleetRequest, migrating: Migrating | None, nvidia: bool,
              best_fit: bool = True) -> HostRejection | tuple[tuple[Any, ...], HostChoice, frozenset[tuple[str, str]]]:
    def no(code: str, reason: str) -> HostRejection:
        return HostRejection(h.name, code, reason)

    if migrating and h.name == migrating.host:
        return no(SOURCE, f"VM {migrating.vm} runs here now")
    if h.stale:
        return no(STALE, f"stale: last heartbeat {h.age_s:.0f} s ago, its window is {h.stale_after_s:g} s")
    if h.cordoned:
        return no(CORDONED, "cordoned" + (f" ({h.cordon_reason})" if h.cordon_reason else ""))
    if not offers:
        return no(NOT_OFFERED, f"offers no {req.type} (no GPU of a model that has it)")
    allowed = [o for o in offers if _model_allowed(o, req)] if req.allow_models or req.deny_models else offers
    if not allowed:
        return no(MODEL_DENIED, f"model {offers[0].model} denied by the policy")
    if migrating:
        allowed, verdict = _compatible(h, allowed, migrating, req)
        if not allowed:
            return no(INCOMPATIBLE, f"incompatible with VM {migrating.vm}: {verdict}")
    open_gpus = sum(o.open_gpus for o in allowed)
    free = sum(o.free for o in allowed)
    gpus = sum(o.gpus for o in allowed)
    enough = open_gpus >= req.count if nvidia else free >= req.count
    if not enough:
        if not open_gpus:
            return no(NO_CAPACITY, f"no capacity: 0 free {req.type} on its {gpus} GPU(s)")
        need = f"{req.count} GPUs with a free {req.type} (one vGPU of a GPU per VM)" if nvidia else \
            f"{req.count} free {req.type}"
        return no(NO_CAPACITY, f"no capacity: {free} free on {open_gpus} GPU(s), {need} needed")
    tightest = min((o.tightest_mb for o in allowed if o.tightest_mb is not None), default=None)
    why = f"{req.strategy}: {free} free {req.type} on {open_gpus} GPU(s)"
    if req.strategy == "pack" and best_fit and tightest is not None:
        why += f", best fit: {tightest} MB left"
    if migrating:
        why += f"; same board and vGPU manager as VM {migrating.vm}'s"
    key = ((_room(tightest) if best_fit else 0, free, h.name) if req.strategy == "pack" else (-free, h.name))
    usable = frozenset((o.model, o.device_id) for o in allowed)
    return key, HostChoice(h.name, h.endpoint, h.migration_uri, (), free, open_gpus, why, tightest), usable


def _room(mb: int | None) -> float:
    """Room left, for `pack`'s order: a GPU whose room is not known after every known one (NULLS LAST)."""
    return float("inf") if mb is None else mb


def _json(c: HostChoice) -> dict[str, Any]:
    d = c._asdict()
    d["gpus"] = list(c.gpus)
    return d


def _by_instances(order: list[GpuOffer], count: int) -> tuple[str, ...]:
    out: list[str] = []
    for o in order:
        out += [o.gpu] * min(o.free, count - len(out))
        if len(out) >= count:
            break
    return tuple(out)


def _model_names(o: OfferGroup) -> set[str]:
    names = {o.model.lower(), o.device_id.lower(), f"10de:{o.device_id}".lower()}
    parsed = parse_type_name(o.name)
    if parsed:
        names.add(parsed.gpu.lower())
    return names


def _model_allowed(o: OfferGroup, req: FleetRequest) -> bool:
    names = _model_names(o)
    if any(m.lower() in names for m in req.deny_models):
        return False
    return not req.allow_models or any(m.lower() in names for m in req.allow_models)


def _compatible(h: HostRow, offers: list[OfferGroup], migrating: Migrating, req: FleetRequest
                ) -> tuple[list[OfferGroup], str]:
    """The host's boards a vGPU of the migrating VM could continue on, live; else NVIDIA's reason why not."""
    vgpus = [v for v in migrating.vgpus if compat.same_type(v.type_name, req.type)] or list(migrating.vgpus)
    ok, reason = [], ""
    for o in offers:
        gpu = compat.CandidateGpu(h.name, o.device_id, o.model, h.driver_version)
        verdict = compat.live_migration(vgpus[0], gpu, offered_type=o.name)
        if verdict.live:
            ok.append(o)
        elif not reason:
            reason = verdict.reason
    return ok, reason
