"""Licence pools and usage, the audit trail (filters, CSV/JSON export, verify), reconcile, tokens."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter, Depends, Path, Query, Response

from api import tokens as token_store
from api.auth import ADMIN_ONLY, READ, require
from api.deps import service
from api.schemas import LicencePoolChange, LicencePoolCreate, ReconcileRequest
from api.tokens import Token
from vgpumgr.audit import chain as audit
from vgpumgr.licensing import seats as licensing
from vgpumgr.service import Service

router = APIRouter(prefix="/v1")
POOL = Path(min_length=1, max_length=64)


def _pool_json(p: Any) -> dict[str, Any]:
    return {"name": p.name, "edition": p.edition, "seats": p.seats, "unit": p.unit,
            "expires": p.expires.isoformat() if p.expires else None}


# -- licences -------------------------------------------------------------------------------------------
@router.get("/licences", tags=["licences"])
def list_licences(svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> list[dict[str, Any]]:
    with svc.sessions() as s:
        return [_pool_json(p) for p in licensing.list_pools(s)]


@router.get("/licences/usage", tags=["licences"])
def licence_usage(svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> dict[str, Any]:
    """Seats, use and holders per edition."""
    with svc.sessions() as s:
        return {"mode": svc.licence_mode, "editions": [e.to_json() for e in licensing.usage(s)]}


@router.post("/licences", status_code=201, tags=["licences"])
def add_licence(body: LicencePoolCreate, svc: Service = Depends(service),
                token: Token = Depends(require(*ADMIN_ONLY))) -> dict[str, Any]:
    with svc.tx() as s:
        pool = licensing.add_pool(s, name=body.name, edition_name=body.edition, seats=body.seats, unit=body.unit,
                                  expires=body.expires)
        out = _pool_json(pool)
        svc.event(s, audit.LICENCE_POOL_ADD, actor=token.actor, detail=out)
    return out


@router.patch("/licences/{name}", tags=["licences"])
def change_licence(body: LicencePoolChange, name: str = POOL, svc: Service = Depends(service),
                   token: Token = Depends(require(*ADMIN_ONLY))) -> dict[str, Any]:
    kw: dict[str, Any] = {"seats": body.seats}
    if body.clear_expiry or body.expires is not None:
        kw["expires"] = None if body.clear_expiry else body.expires
    with svc.tx() as s:
        out = _pool_json(licensing.change_pool(s, name, **kw))
        svc.event(s, audit.LICENCE_POOL_CHANGE, actor=token.actor, detail=out)
    return out


@router.delete("/licences/{name}", tags=["licences"])
def remove_licence(name: str = POOL, svc: Service = Depends(service),
                   token: Token = Depends(require(*ADMIN_ONLY))) -> dict[str, Any]:
    with svc.tx() as s:
        licensing.remove_pool(s, name)
        svc.event(s, audit.LICENCE_POOL_REMOVE, actor=token.actor, detail={"name": name})
    return {"removed": name}


# -- audit ----------------------------------------------------------------------------------------------
@router.get("/audit", tags=["audit"], responses={200: {"content": {"text/csv": {"schema": {"type": "string"}}}}})
def audit_events(vm: str | None = Query(default=None, max_length=64), gpu: str | None = Query(default=None,
                 max_length=32), vgpu: str | None = Query(default=None, max_length=64),
                 actor: str | None = Query(default=None, max_length=128),
                 action: str | None = Query(default=None, max_length=64),
                 outcome: str | None = Query(default=None, pattern="^(ok|failed|warning)$"),
                 since: datetime | None = None, until: datetime | None = None,
                 limit: int = Query(default=1000, ge=1, le=100_000), newest_first: bool = False,
                 format: str = Query(default="json", pattern="^(json|csv)$"),
                 svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> Any:
    """Audit events matching every filter (`since` inclusive, `until` exclusive), as JSON or CSV."""
    with svc.sessions() as s:
        events = audit.query(s, vm=vm, gpu=gpu, vgpu=vgpu, actor=actor, action=action, outcome=outcome,
                             since=since, until=until, limit=limit, newest_first=newest_first)
        if format == "csv":
            return Response(audit.to_csv(events), media_type="text/csv",
                            headers={"Content-Disposition": 'attachment; filename="vgpumgr-audit.csv"'})
        return [audit.to_dict(e) for e in events]


@router.get("/audit/verify", tags=["audit"])
def audit_verify(svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> dict[str, Any]:
    """Walk the hash chain and compare it with the signed checkpoints; `ok` false names the first event altered,
    deleted or inserted, or the first checkpoint the database contradicts."""
    result = svc.verify_audit()
    return {**result.to_json(), "message": result.message()}


# -- reconcile ------------------------------------------------------------------------------------------
@router.get("/reconcile", tags=["reconcile"])
def reconcile_report(svc: Service = Depends(service), token: Token = Depends(require(*READ))) -> dict[str, Any]:
    """Records versus sysfs: vGPUs that vanished, and devices nobody recorded. Changes nothing."""
    return svc.reconcile(fix=False, actor=token.actor)


@router.post("/reconcile", tags=["reconcile"])
def reconcile_fix(body: ReconcileRequest, svc: Service = Depends(service),
                  token: Token = Depends(require(*ADMIN_ONLY))) -> dict[str, Any]:
    return svc.reconcile(fix=body.fix, remove_unknown=body.remove_unknown, actor=token.actor)


# -- tokens ---------------------------------------------------------------------------------------------
@router.get("/tokens", tags=["tokens"])
def list_tokens(svc: Service = Depends(service), _: Token = Depends(require(*ADMIN_ONLY))) -> list[dict[str, Any]]:
    return token_store.list_tokens(svc.cfg)
