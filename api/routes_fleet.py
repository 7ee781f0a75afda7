"""This host and the fleet: cordon and uncordon (`vgpumgr host ...`), what every host published, and which host
should take a vGPU (`vgpumgr fleet ...`). The fleet's answers come from the rows the hosts published; the chosen
host's own service allocates, and its placement decides."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from api.auth import READ, VM_WRITE, require
from api.deps import service
from api.tokens import Token
from vgpumgr.fleet.place import MAX_COUNT, FleetRequest
from vgpumgr.service import Service

router = APIRouter(prefix="/v1")
TYPE = Query(min_length=1, max_length=128, description="short name (L40S-4Q), full name or type id")
HOST = Field(default=None, min_length=1, max_length=255, description="the host (default: the one serving)")


class CordonIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str | None = HOST
    reason: str | None = Field(default=None, max_length=500, description="why, shown with the host")


class UncordonIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str | None = HOST


@router.get("/host", tags=["fleet"])
def host_status(host: str | None = Query(default=None, min_length=1, max_length=255),
                svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> dict[str, Any]:
    """Whether a host (default: this one) is cordoned, why, since when and by whom."""
    return svc.host_status(host)


@router.get("/host/doctor", tags=["fleet"])
def host_doctor(gpu: str | None = Query(default=None, max_length=16, description="only this GPU's checks"),
                svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> dict[str, Any]:
    """`vgpumgr doctor --json` of the host serving: every check with its level (PASS, NOTE, WARN, FAIL), what was
    found and, for every result that is not PASS, the hint that fixes it; `ok` is false when a check FAILs."""
    from vgpumgr.ops.doctor.registry import run

    return run(svc.cfg, svc.hostname, gpu).as_dict()


@router.post("/host/cordon", tags=["fleet"])
def cordon(body: CordonIn, svc: Service = Depends(service), token: Token = Depends(require(*VM_WRITE))
           ) -> dict[str, Any]:
    """Cordon a host: `fleet place` never chooses it and live migrations into it are refused; what runs there
    stays and local requests still work. `changed` is false when it was already cordoned for that reason."""
    return svc.cordon_host(body.host, reason=body.reason, actor=token.actor)


@router.post("/host/uncordon", tags=["fleet"])
def uncordon(body: UncordonIn, svc: Service = Depends(service), token: Token = Depends(require(*VM_WRITE))
             ) -> dict[str, Any]:
    return svc.uncordon_host(body.host, actor=token.actor)


@router.get("/fleet/hosts", tags=["fleet"])
def fleet_hosts(svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> list[dict[str, Any]]:
    """Every host that published: its heartbeat's age and window (`stale` past it), cordon, endpoint, driver."""
    return svc.fleet_hosts()


@router.get("/fleet/gpus", tags=["fleet"])
def fleet_gpus(host: str | None = Query(default=None, min_length=1, max_length=255),
               type: str | None = Query(default=None, min_length=1, max_length=128),
               svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> list[dict[str, Any]]:
    """The hosts' GPUs (model, PCI and subsystem ids, driver version, mode, NUMA node); with `type`, only those
    offering it, with its free, used and max instances."""
    return svc.fleet_gpus(host, type)


@router.get("/fleet/capacity", tags=["fleet"])
def fleet_capacity(type: str | None = Query(default=None, min_length=1, max_length=128),
                   svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> dict[str, Any]:
    """Per type across the fleet; with `type`, per host (stale and cordoned hosts marked)."""
    return svc.fleet_capacity(type)


@router.get("/fleet/place", tags=["fleet"])
def fleet_place(request: Request, type: str = TYPE, vm: str | None = Query(default=None, min_length=1, max_length=64),
                count: int = Query(default=1, ge=1, le=MAX_COUNT),
                policy: Literal["pack", "spread"] = "pack",
                allow_model: list[str] = Query(default=[], max_length=32),
                deny_model: list[str] = Query(default=[], max_length=32),
                every_host: bool = False,
                svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> dict[str, Any]:
    """Which host should take `count` vGPUs of `type` (for `vm`: a VM recorded on another host is being moved,
    and NVIDIA's live-migration rules apply), ranked, and why each other host should not. A fleet of over 200
    hosts gets its best five hosts and the others counted by reason (`every_host`: false, `rejected_counts`),
    unless `every_host=true`. Changes nothing: ask the chosen host's own service to allocate (`POST /v1/vgpus`
    there), whose placement is the final word."""
    started, result = time.perf_counter(), "error"
    try:
        req = FleetRequest(type, vm=vm, count=count, strategy=policy, allow_models=tuple(allow_model),
                           deny_models=tuple(deny_model))
        d = svc.fleet_place(req, every_host=every_host)
        result = "placed" if d.choice is not None else "no_room"
        return d.as_dict()
    finally:
        request.app.state.metrics.observe_fleet_place(time.perf_counter() - started, result)


class CompactIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str = Field(min_length=1, max_length=128, description="the vGPU type to make room for")
    apply: bool = Field(default=False, description="migrate the planned VMs (from this host), one at a time")
    max_moves: int = Field(default=8, ge=1, le=64)
    per_host: int = Field(default=2, ge=1, le=64, description="at most this many moves into one host")


@router.get("/fleet/compact", tags=["fleet"])
def fleet_compact_plan(type: str = TYPE, max_moves: int = Query(default=8, ge=1, le=64),
                       per_host: int = Query(default=2, ge=1, le=64), svc: Service = Depends(service),
                       _: Token = Depends(require(*READ))) -> dict[str, Any]:
    """The fewest live migrations across the fleet that free a placement of `type` on some host: each move's
    VM, its host, the destination and why it fits there (`feasible` false, with `why`, when none does)."""
    return svc.fleet_compact_plan(type, max_moves=max_moves, per_host=per_host)


@router.post("/fleet/compact", tags=["fleet"])
def fleet_compact(body: CompactIn, svc: Service = Depends(service), token: Token = Depends(require(*VM_WRITE))
                  ) -> dict[str, Any]:
    """Plan as GET does; with `apply`, migrate the planned VMs one at a time from this host (the one whose GPU
    is freed: 409 naming it otherwise), stopping at the first failure (the error names what was moved)."""
    from vgpumgr.ops import fleet_compact as ops

    p = svc.fleet_compact_plan(body.type, max_moves=body.max_moves, per_host=body.per_host)
    if body.apply:
        p = svc.fleet_compact_apply(p, actor=token.actor)
        err = ops.failure(p)
        if err is not None:
            raise err
    return p


@router.post("/fleet/publish", tags=["fleet"])
def fleet_publish(svc: Service = Depends(service), _: Token = Depends(require(*VM_WRITE))) -> dict[str, Any]:
    """Publish this host now, all of it (as its heartbeat does)."""
    return svc.publish_fleet()
