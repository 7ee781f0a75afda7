"""Per-VM vGPU telemetry and the licence check over REST (the same snapshot /metrics renders)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from api.auth import READ, VM_WRITE, require
from api.deps import service
from api.schemas import GuestTelemetryChoice
from api.tokens import Token
from vgpumgr import ids
from vgpumgr.service import Service

router = APIRouter(prefix="/v1", tags=["telemetry"])


@router.get("/telemetry")
def telemetry(request: Request, gpu: str | None = Query(default=None, max_length=16),
              _: Token = Depends(require(*READ))) -> dict[str, Any]:
    """Every running vGPU of this host with what NVML reports of it, joined with its VM, allocation and seat:
    the newest sample (the one /metrics shows)."""
    snap = request.app.state.sampler.latest()
    if gpu:
        address = ids.pci_address(gpu)
        snap = {**snap, "vgpus": [r for r in snap["vgpus"] if r["gpu"] == address],
                "gpus": [g for g in snap["gpus"] if g["gpu"] == address]}
    return snap


@router.post("/licences/check")
def licence_check(request: Request, svc: Service = Depends(service), token: Token = Depends(require(*READ))
                  ) -> dict[str, Any]:
    """The seat ledger against what each running guest reports; new findings are audited once."""
    return svc.licence_check(request.app.state.sampler.latest(), actor=token.actor)


@router.get("/licences/deliveries")
def licence_deliveries(svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> dict[str, Any]:
    """How each VM gets NVIDIA's client configuration token, and the tokens set on this host: fingerprints,
    servers and expiries only, never a token."""
    return {"tokens": svc.licence_tokens(), "vms": list(svc.licence_deliveries().values())}


@router.post("/licences/deliver/{name}")
def licence_deliver(name: str, svc: Service = Depends(service), token: Token = Depends(require(*VM_WRITE))
                    ) -> dict[str, Any]:
    """Write the token into the running VM's guest through the QEMU guest agent and restart its licensing."""
    return svc.deliver_licence_token(name, actor=token.actor)


@router.get("/guests/telemetry")
def guest_telemetry_choices(svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> dict[str, Any]:
    """Which VMs and licence pools are read from inside their guests (off where nothing is chosen)."""
    from vgpumgr.ops import guest_watch

    return guest_watch.choices(svc)


@router.put("/guests/telemetry")
def guest_telemetry_choose(body: GuestTelemetryChoice, svc: Service = Depends(service),
                           token: Token = Depends(require(*VM_WRITE))) -> dict[str, Any]:
    """Choose guest-side telemetry (through the QEMU guest agent) for one VM or one licence pool's VMs."""
    from vgpumgr.errors import InvalidInput
    from vgpumgr.ops import guest_watch

    if (body.vm is None) == (body.pool is None):
        raise InvalidInput("name either a VM or a pool", hint='e.g. {"vm": "cad1", "telemetry": "on"}')
    if body.pool is not None:
        return guest_watch.set_pool(svc, body.pool, body.telemetry, actor=token.actor)
    return guest_watch.set_vm(svc, body.vm or "", body.telemetry, actor=token.actor)


@router.post("/guests/check")
def guests_check(svc: Service = Depends(service), driver: str | None = Query(default=None, max_length=32),
                 token: Token = Depends(require(*READ))) -> dict[str, Any]:
    """Every vGPU VM whose guest driver the host driver (or the planned `driver`) does not accept; new findings
    are audited once."""
    from vgpumgr.ops import guest_check

    return guest_check.check(svc, driver, actor=token.actor)
