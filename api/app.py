"""The FastAPI app: `create_app(cfg, service)`; OpenAPI at /docs, Prometheus metrics at /metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Response
from sqlalchemy import text

from api import problems, routes_admin, routes_fleet, routes_inventory, routes_mixed, routes_telemetry, routes_vms, ui
from api.auth import current_token
from api.deps import service as service_dep
from api.metrics import Metrics
from api.watch import InventoryWatcher
from vgpumgr.config import Config
from vgpumgr.db.session import get_engine
from vgpumgr.fleet.heartbeat import Heartbeat
from vgpumgr.service import Service

API_VERSION = "1"
DESCRIPTION = """Manage GPUs, vGPUs, VMs, licences and the audit trail of one KVM/libvirt host.

Authenticate with `Authorization: Bearer <token>` (`vgpumgr token create --name N --role R`).
Roles: admin (everything), operator (VMs and vGPUs), hook (allocate/release vGPUs of a VM), auditor (read-only).
Errors are `application/problem+json` (RFC 9457) with a `hint` saying what to do.
Mutating calls take an `Idempotency-Key` header: a retry with the same key gets the same result."""


def create_app(cfg: Config | None = None, service: Service | None = None, watch: bool = True,
               endpoint: str | None = None, metrics_public: bool = False) -> FastAPI:
    """The app for `service` (default: a Service for `cfg`, default: Config.resolve()); `endpoint`: where it
    answers, published for the fleet unless VGPUMGR_FLEET_ENDPOINT says otherwise. `/metrics` names VMs, GPUs and
    delivery times: it needs a token of any role unless `metrics_public` (`serve --metrics-public`, and a unix
    socket, whose file mode already decides who may connect)."""
    if service is None:
        service = Service(cfg or Config.resolve())
    watcher = InventoryWatcher(service)
    service.fleet.endpoint = service.fleet.endpoint or endpoint
    def beat() -> None:
        if service.check_schema() is None and service.fleet.enabled:  # never write to a schema it cannot use
            service.publish_fleet(heartbeat=True)

    heartbeat = Heartbeat(beat, service.fleet.heartbeat_s)
    from vgpumgr.telemetry.sampler import Sampler

    sampler = Sampler(service)
    # before the server binds its socket: a client that can connect finds no dead reservation left
    rolled_back_at_start = service.reap_dead_reservations(actor="vgpumgr:start")
    # and no record a lost Proxmox post-stop left (local evidence only: libvirt is not asked here, as a libvirt
    # hook may be what started the service and libvirtd answers nothing until that hook returns)
    stale_at_start = service.release_stale_records(libvirt=False, actor="vgpumgr:start")["stale_records"]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.rolled_back_at_start = rolled_back_at_start
        app.state.stale_released_at_start = stale_at_start
        app.state.inventory_updates = watcher.start() if watch else "ttl"
        heartbeat.start()  # checks the schema and publishes this host in full now, then every heartbeat
        if watch:
            sampler.start()
        try:
            yield
        finally:
            heartbeat.stop()
            watcher.stop()
            sampler.stop()

    app = FastAPI(title="vgpumgr", version=API_VERSION, description=DESCRIPTION, lifespan=lifespan)
    app.state.service = service
    app.state.engine = get_engine(service.cfg.db_url)
    app.state.sampler = sampler
    app.state.metrics = Metrics(service, sampler)
    app.state.inventory_updates = "ttl"
    problems.install(app)
    app.include_router(routes_inventory.router)
    app.include_router(routes_vms.router)
    app.include_router(routes_admin.router)
    app.include_router(routes_fleet.router)
    app.include_router(routes_telemetry.router)
    app.include_router(routes_mixed.router)
    app.include_router(ui.router)

    @app.get("/v1/health", tags=["health"])
    def health(svc: Service = Depends(service_dep)) -> dict[str, Any]:
        """Liveness and readiness: database reachable, sysfs readable. No token needed."""
        with svc.sessions() as s:
            s.execute(text("SELECT 1"))
        gpus = len(svc.snapshot().inventory.gpus)
        return {"status": "ok", "host": svc.hostname, "gpus": gpus, "simulated": svc.host.simulated,
                "inventory_updates": app.state.inventory_updates, "licence_mode": svc.licence_mode}

    @app.get("/metrics", tags=["health"], response_class=Response,
             dependencies=[] if metrics_public else [Depends(current_token)],
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    def metrics() -> Response:
        """Prometheus metrics; a bearer token of any role unless the service runs with --metrics-public."""
        return Response(app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
