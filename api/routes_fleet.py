"""This host and the fleet: cordon and uncordon (`vgpumgr host ...`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from api.auth import READ, VM_WRITE, require
from api.deps import service
from api.tokens import Token
from vgpumgr.service import Service

router = APIRouter(prefix="/v1")
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
