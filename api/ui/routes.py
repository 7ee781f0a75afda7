"""The web view under /ui: server-rendered pages over the same Service the REST routes use.

Reads need a token of role admin, operator or auditor (as GET /v1/...); creating and releasing vGPUs needs
admin or operator and a valid CSRF token, and goes through Service.allocate/release with the token as actor.
Errors are pages, not problem+json: the status stays the REST API's (400, 403, 404, 409...).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Coroutine
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool

from api.deps import service
from api.tokens import Token, lookup
from api.ui import session as ui_session
from api.ui import views
from api.ui.session import COOKIE, LOGIN_COOKIE, LoginRequired, changer, form, reader
from vgpumgr import ids
from vgpumgr.audit import chain as audit
from vgpumgr.errors import InvalidInput, VgpuError
from vgpumgr.licensing import seats as licensing
from vgpumgr.placement.placer import Policy
from vgpumgr.service import Service

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=str(HERE / "templates"))
CSS = (HERE / "static" / "ui.css").read_bytes()
HEADERS = {"Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
                                      "frame-ancestors 'none'; base-uri 'none'",
           "X-Frame-Options": "DENY", "Referrer-Policy": "same-origin", "X-Content-Type-Options": "nosniff",
           "Cache-Control": "no-store"}
OUTCOMES = "^(ok|failed|warning)$"
STATES = "^(reserved|active|released)$"


def render(request: Request, name: str, status: int = 200, **ctx: Any) -> Response:
    ctx.setdefault("token", getattr(request.state, "ui_token", None))
    ctx.setdefault("csrf", getattr(request.state, "csrf", ""))
    ctx.setdefault("notice", request.query_params.get("notice", "")[:300])
    ctx.setdefault("can_change", bool(ctx["token"]) and ctx["token"].role in ui_session.CHANGE)
    resp = templates.TemplateResponse(request, name, ctx, status_code=status)
    resp.headers.update(HEADERS)
    return resp


class UiRoute(APIRoute):
    """Turns what a handler raises into a page: login redirect, or an error page with the error's status."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except LoginRequired as exc:
                where = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                q = {"next": where, **({"reason": exc.reason} if exc.reason else {})}
                return RedirectResponse("/ui/login?" + urlencode(q), status_code=303, headers=HEADERS)
            except VgpuError as exc:
                return render(request, "error.html", exc.status, title=exc.kind.replace("-", " "),
                              message=exc.message, hint=exc.hint)
            except RequestValidationError as exc:
                where = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:])}: {e.get('msg', '')}"
                                  for e in exc.errors()[:5])
                return render(request, "error.html", 400, title="bad request",
                              message=f"the address has a bad parameter: {where}",
                              hint="fix or drop that parameter; the page's own filters give valid values")

        return run


router = APIRouter(prefix="/ui", route_class=UiRoute, include_in_schema=False)


@router.get("/static/ui.css")
def css() -> Response:
    return Response(CSS, media_type="text/css", headers={"Cache-Control": "max-age=3600"})


# -- login ---------------------------------------------------------------------------------------------
@router.get("/login")
def login_page(request: Request, next: str | None = Query(default=None, max_length=512),
               reason: str | None = Query(default=None, max_length=200)) -> Response:
    nonce = secrets.token_urlsafe(24)
    resp = render(request, "login.html", login_csrf=nonce, next=ui_session.safe_next(next), error=reason or "")
    resp.set_cookie(LOGIN_COOKIE, nonce, httponly=True, samesite="strict", path="/ui",
                    secure=ui_session.secure_cookie(request), max_age=3600)
    return resp


@router.post("/login")
async def login(request: Request, fields: dict[str, str] = Depends(form)) -> Response:
    ui_session.check_csrf(request, fields.get("csrf", ""), request.cookies.get(LOGIN_COOKIE) or "-")
    secret = fields.get("token", "").strip()
    token = lookup(request.app.state.engine, secret) if secret else None
    if token is None:
        nonce = secrets.token_urlsafe(24)
        resp = render(request, "login.html", 401, login_csrf=nonce, next=ui_session.safe_next(fields.get("next")),
                      error="that token is unknown or revoked; `vgpumgr token create --role auditor` makes one")
        resp.set_cookie(LOGIN_COOKIE, nonce, httponly=True, samesite="strict", path="/ui",
                        secure=ui_session.secure_cookie(request), max_age=3600)
        return resp
    resp = RedirectResponse(ui_session.safe_next(fields.get("next")), status_code=303, headers=HEADERS)
    resp.set_cookie(COOKIE, secret, httponly=True, samesite="strict", path="/",
                    secure=ui_session.secure_cookie(request))
    resp.delete_cookie(LOGIN_COOKIE, path="/ui")
    return resp


@router.post("/logout")
async def logout(request: Request, fields: dict[str, str] = Depends(form)) -> Response:
    _, secret = ui_session.current(request)
    ui_session.check_csrf(request, fields.get("csrf", ""), ui_session.csrf_for(request, secret))
    resp = RedirectResponse("/ui/login", status_code=303, headers=HEADERS)
    resp.delete_cookie(COOKIE, path="/")
    return resp


# -- pages ---------------------------------------------------------------------------------------------
@router.get("")
@router.get("/")
def overview(request: Request, svc: Service = Depends(service), _: Token = Depends(reader)) -> Response:
    inv = svc.snapshot().inventory
    live = views.live_by_ref(svc)
    chain = svc.verify_audit()
    with svc.sessions() as s:
        editions = licensing.usage(s)
    return render(request, "overview.html", host=svc.hostname, simulated=svc.host.simulated,
                  gpus=views.overview_rows(inv, live), live=len(live), chain=chain, editions=editions,
                  licence_mode=svc.licence_mode)


@router.get("/gpus/{address}")
def gpu_page(request: Request, address: str, svc: Service = Depends(service), _: Token = Depends(reader)
             ) -> Response:
    address = ids.pci_address(address)
    found = views.slot_map(svc, address)
    if found is None:
        return render(request, "error.html", 404, title="not found", message=f"no GPU {address}",
                      hint="the host overview lists the GPUs")
    if found.gpu.is_vf:
        pf, vf = quote(found.gpu.physical, safe=":"), quote(address, safe=":")
        return RedirectResponse(f"/ui/gpus/{pf}#vf-{vf}", status_code=303)
    return render(request, "gpu.html", m=found, creatable=[t for t in found.types if t.available > 0
                                                           and not t.mig_profile],
                  placement=_placement_map(svc, address))


def _placement_map(svc: Service, address: str) -> dict[str, Any] | None:
    """Mixed-size mode, or equal-size mode with homogeneous placement IDs (Ada+, R570+): the GPU's placement map
    (vgpumgr.ops.slot_map), one cell per GB; None otherwise."""
    from vgpumgr.ops import slot_map

    m = slot_map.slot_map(svc, address)
    if m["mode"] != "mixed" and m.get("placements") != "homogeneous":
        return None
    row = slot_map.cells(m)
    order = {label: n % 8 for n, label in enumerate(dict.fromkeys(c for c in row if c))}
    m["cells"] = [{"label": c, "colour": order.get(c)} for c in row]
    return m


@router.get("/fleet")
def fleet_page(request: Request, type: str | None = Query(default=None, max_length=128),
               state: str | None = Query(default=None, pattern="^(ok|stale|cordoned)?$"),
               page: int = Query(default=1, ge=1, le=100_000), svc: Service = Depends(service),
               _: Token = Depends(reader)) -> Response:
    type, state = (v.strip() or None if v else None for v in (type, state))
    grid = svc.fleet_grid(type_name=type, state=state, page=page)
    return render(request, "fleet.html", g=grid, me=svc.hostname, boxes=views.fleet_boxes,
                  pages_of=views.host_pages, f={"type": type or "", "state": state or ""})


@router.get("/vms")
def vms_page(request: Request, svc: Service = Depends(service), _: Token = Depends(reader)) -> Response:
    error = None
    try:
        vms = svc.list_vms()
    except VgpuError as exc:  # libvirt unreachable: still show the recorded vGPUs
        vms, error = [], str(exc)
    by_vm: dict[str, list[dict[str, Any]]] = {}
    for a in svc.allocations(live=True):
        by_vm.setdefault(a["vm"] or "", []).append(a)
    return render(request, "vms.html", vms=vms, by_vm=by_vm, error=error)


@router.get("/placements")
def placements_page(request: Request, vm: str | None = Query(default=None, max_length=64),
                    gpu: str | None = Query(default=None, max_length=32),
                    state: str | None = Query(default=None, pattern=STATES + "|^$"),
                    type: str | None = Query(default=None, max_length=128),
                    svc: Service = Depends(service), _: Token = Depends(reader)) -> Response:
    vm, gpu, type, state = (v.strip() or None if v else None for v in (vm, gpu, type, state))
    rows = svc.allocations(vm=ids.vm_name(vm) if vm else None, gpu=ids.pci_address(gpu) if gpu else None,
                           state=state, live=None if state else True)
    if type:
        rows = [a for a in rows if type in (a["type"], a["type_name"]) or (a["type_name"] or "").endswith(" " + type)]
    return render(request, "placements.html", rows=rows, f={"vm": vm or "", "gpu": gpu or "", "state": state or "",
                                                             "type": type or ""})


@router.get("/licences")
def licences_page(request: Request, svc: Service = Depends(service), _: Token = Depends(reader)) -> Response:
    with svc.sessions() as s:
        editions = licensing.usage(s)
    check = svc.licence_check(request.app.state.sampler.latest(), audit=False)  # a page only shows
    from vgpumgr.licensing import token as licence_token
    from vgpumgr.ops import licence_delivery

    return render(request, "licences.html", editions=editions, mode=svc.licence_mode, check=check,
                  deliveries=list(licence_delivery.records(svc).values()),
                  tokens=licence_token.all_info(svc.cfg.state_dir))


@router.get("/telemetry")
def telemetry_page(request: Request, _: Token = Depends(reader)) -> Response:
    from api.ui.charts import chart, share_chart

    sampler = request.app.state.sampler
    snap = sampler.latest()
    now, since = snap["taken"], snap["taken"] - sampler.history.span_s

    def drawn(kind: str) -> list[dict[str, Any]]:
        out = []
        for s in sampler.history.series(kind, since):
            title = f"{s['labels'].get('vm') or s['labels']['gpu']}: utilisation over the last hour"
            out.append({**s, "svg": chart(s["points"], now, sampler.history.span_s, title=title)})
        return out

    shares = [{"gpu": g["gpu"], "scheduler": g["scheduler"],
               "svg": share_chart([r for r in snap["vgpus"] if r["gpu"] == g["gpu"]],
                                  title=f"{g['gpu']}: share of GPU time per VM ({g['scheduler']['policy']})")}
              for g in snap["gpus"] if g.get("scheduler") and g["vgpus"]]
    return render(request, "telemetry.html", snap=snap, interval=f"{sampler.interval:g}",
                  taken=datetime.fromtimestamp(now).strftime("%H:%M:%S"), vgpu_series=drawn("vgpu"),
                  gpu_series=drawn("gpu"), shares=shares)


def _when(name: str, text: str | None) -> datetime | None:
    if not text or not text.strip():
        return None
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidInput(f"`{name}` '{text}' is not a date or time",
                           hint="use ISO 8601: 2025-01-31 or 2025-01-31T08:00 (UTC unless an offset is given)"
                           ) from None


def _audit_filters(vm: str | None, gpu: str | None, vgpu: str | None, actor: str | None, action: str | None,
                   outcome: str | None, since: str | None, until: str | None, limit: int) -> dict[str, Any]:
    f: dict[str, Any] = {k: (v.strip() or None) if v else None for k, v in
                         {"vm": vm, "gpu": gpu, "vgpu": vgpu, "actor": actor, "action": action,
                          "outcome": outcome}.items()}
    f["since"], f["until"] = _when("since", since), _when("until", until)
    if f["since"] and f["until"] and f["since"] >= f["until"]:
        raise InvalidInput("`since` is not before `until`", hint="give since < until (until is exclusive)")
    return {**f, "limit": limit}


class AuditQuery:
    def __init__(self, vm: str | None = Query(default=None, max_length=64),
                 gpu: str | None = Query(default=None, max_length=32),
                 vgpu: str | None = Query(default=None, max_length=64),
                 actor: str | None = Query(default=None, max_length=128),
                 action: str | None = Query(default=None, max_length=64),
                 outcome: str | None = Query(default=None, pattern=OUTCOMES + "|^$"),
                 since: str | None = Query(default=None, max_length=40),
                 until: str | None = Query(default=None, max_length=40),
                 limit: int = Query(default=200, ge=1, le=100_000)) -> None:
        self.filters = _audit_filters(vm, gpu, vgpu, actor, action, outcome, since, until, limit)


@router.get("/audit")
def audit_page(request: Request, q: AuditQuery = Depends(), svc: Service = Depends(service),
               _: Token = Depends(reader)) -> Response:
    with svc.sessions() as s:
        events = [audit.to_dict(e) for e in audit.query(s, newest_first=True, **q.filters)]
    chain = svc.verify_audit()
    shown = {k: ("" if v is None else (v.isoformat() if isinstance(v, datetime) else str(v)))
             for k, v in q.filters.items()}
    export = urlencode({k: v for k, v in shown.items() if v})
    return render(request, "audit.html", events=events, chain=chain, f=shown, export=export)


@router.get("/audit/export")
def audit_export(request: Request, q: AuditQuery = Depends(), format: str = Query(default="csv",
                 pattern="^(csv|json)$"), svc: Service = Depends(service), _: Token = Depends(reader)) -> Response:
    with svc.sessions() as s:
        events = audit.query(s, **q.filters)
        body = audit.to_csv(events) if format == "csv" else audit.to_json(events)
    media = "text/csv" if format == "csv" else "application/json"
    return Response(body, media_type=media, headers={
        "Content-Disposition": f'attachment; filename="vgpumgr-audit.{format}"', "Cache-Control": "no-store"})


@router.get("/doctor")
def doctor_page(request: Request, svc: Service = Depends(service), _: Token = Depends(reader)) -> Response:
    from vgpumgr.ops.doctor.registry import run

    report = run(svc.cfg, svc.hostname)
    sections: dict[str, list[Any]] = {}
    for r in report.results:
        sections.setdefault(r.section, []).append(r)
    return render(request, "doctor.html", host=svc.hostname, sections=sections, counts=report.counts(),
                  failed=report.failed)


@router.get("/reconcile")
def reconcile_page(request: Request, svc: Service = Depends(service), token: Token = Depends(reader)
                   ) -> Response:
    report = svc.reconcile(fix=False, actor=token.actor)
    return render(request, "reconcile.html", r=report)


# -- changes -------------------------------------------------------------------------------------------
@router.post("/vgpus")
async def create_vgpu(request: Request, fields: dict[str, str] = Depends(form), svc: Service = Depends(service)
                      ) -> Response:
    token = changer(request, fields)
    gpu = ids.pci_address(fields.get("gpu", ""))
    type_name = fields.get("type", "").strip()
    if not type_name:
        raise InvalidInput("no vGPU type was chosen", hint="pick a type in the form's list")
    vm = fields.get("vm", "").strip() or None
    made = await run_in_threadpool(lambda: svc.allocate(type_name, vm=vm, policy=Policy(pin_gpu=gpu),
                                                        actor=token.actor))
    ref = made.get("uuid") or made.get("pci_address")
    notice = f"created {made.get('type_name') or made.get('type')} {ref}" + (f" for VM {vm}" if vm else "")
    return RedirectResponse(f"/ui/gpus/{quote(gpu, safe=':')}?" + urlencode({"notice": notice}), status_code=303,
                            headers=HEADERS)


@router.post("/vgpus/{ref}/release")
async def release_vgpu(request: Request, ref: str, fields: dict[str, str] = Depends(form),
                       svc: Service = Depends(service)) -> Response:
    token = changer(request, fields)
    ref = ref if ids.is_pci_address(ref) else ids.mdev_uuid(ref)
    await run_in_threadpool(lambda: svc.release(ref, actor=token.actor))
    back = ui_session.safe_next(fields.get("back")).split("?")[0]
    return RedirectResponse(f"{back}?" + urlencode({"notice": f"released {ref}"}), status_code=303, headers=HEADERS)
