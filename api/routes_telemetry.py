"""Per-VM vGPU telemetry and the licence check over REST (the same snapshot /metrics renders)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from api.auth import READ, VM_WRITE, require
from api.deps import service
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
