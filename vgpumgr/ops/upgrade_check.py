"""`vgpumgr upgrade check`: run by the release about to be started on this host (installed, not yet restarted),
it says what the upgrade will do and what would break. It reads the database with plain SQL, so it works on a
schema older or newer than its own, and it changes nothing.

Findings are "block" (the upgrade would break something: exit 10), "warn" or "info":
- schema: the steps `db upgrade` would apply and their phase, contract steps held back and the hosts that hold
  them, a database this code cannot use;
- fleet: hosts that last ran another vgpumgr version (live or not);
- vms: vGPU VMs recorded as running here (a vgpumgr upgrade leaves them alone; a kernel or driver change does
  not: drain first);
- kernel: the next boot's kernel (newest in /boot, or --kernel) against what the recorded vGPUs need: NVIDIA's
  vendor-specific VF interface exists from kernel 6.8 on;
- driver: the NVIDIA host driver (/sys/module/nvidia/version) against --driver: a new branch may not offer
  the recorded vGPU types, and unloading it stops every vGPU VM;
- gpu: per NVIDIA GPU, from the support matrix (ops/upgrade_gpus.py): a branch that does not support the card, a
  kernel the driver is known not to build on, mixed-size mode or MIG-backed vGPU lost.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from vgpumgr.config import Config
from vgpumgr.db import schema
from vgpumgr.db.models import LIVE_STATES, utcnow
from vgpumgr.db.session import READ_ONLY, get_engine, stored_state
from vgpumgr.errors import SchemaMismatch
from vgpumgr.kinds import BACKEND_NVIDIA_VF
from vgpumgr.ops import upgrade_gpus
from vgpumgr.ops.upgrade_gpus import GuestRule

VENDOR_VF_KERNEL = (6, 8)
VENDOR_VF_BACKENDS = (BACKEND_NVIDIA_VF,)


@dataclass
class Finding:
    severity: str  # block | warn | info
    area: str
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"severity": self.severity, "area": self.area, "message": self.message}


@dataclass
class Report:
    host: str
    version: str
    schema: dict[str, Any]
    hosts: list[dict[str, Any]]
    vms: list[str]
    kernel: dict[str, str | None]
    driver: dict[str, str | None]
    findings: list[Finding] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)

    @property
    def blocked(self) -> bool:
        return any(f.severity == "block" for f in self.findings)

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "version": self.version, "ok": not self.blocked, "schema": self.schema,
                "hosts": self.hosts, "vms": self.vms, "kernel": self.kernel, "driver": self.driver,
                "gpus": self.gpus, "findings": [f.as_dict() for f in self.findings]}


def kernel_tuple(release: str | None) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", release or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def running_kernel(cfg: Config) -> str | None:
    try:
        return (cfg.host.root / "proc/sys/kernel/osrelease").read_text().strip() or None
    except OSError:
        return None


def newest_installed_kernel(cfg: Config) -> str | None:
    found = [p.name.removeprefix("vmlinuz-") for p in (cfg.host.root / "boot").glob("vmlinuz-*")]
    return max(found, key=lambda r: [int(x) if x.isdigit() else 0 for x in re.split(r"[.\-+~]", r)], default=None)


def nvidia_driver(cfg: Config) -> str | None:
    try:
        return (cfg.host.root / "sys/module/nvidia/version").read_text().strip() or None
    except OSError:
        return None


def check(cfg: Config, hostname: str, *, kernel: str | None = None, driver: str | None = None,
          window: timedelta = schema.LIVE_WINDOW, guests: GuestRule | None = None) -> Report:
    """`guests`: the guest/host driver window rule (upgrade_gpus.GuestRule), asked per VM with vGPUs here."""
    from sqlalchemy import bindparam, text

    engine = get_engine(cfg.db_url)
    state = stored_state(cfg.db_url) or schema.State(None)  # no schema yet: State(None)
    known = (state.ordinal or 0) >= 1
    hosts: list[schema.HostVersion] = []
    records: list[tuple[str | None, str, str | None, str, str | None]] = []
    modes: dict[str, str] = {}
    with engine.connect().execution_options(**{READ_ONLY: True}) as conn:  # no write lock: it changes nothing
        if (state.ordinal or 0) >= 9:
            hosts = schema.host_versions(conn, utcnow(), window)
        elif known:  # a database from before 0009: hosts without recorded versions
            hosts = [schema.HostVersion(n, None, None, None, False)
                     for (n,) in conn.execute(text("SELECT name FROM hosts ORDER BY name"))]
        if known:
            live = bindparam("live", expanding=True)
            rows = conn.execute(text(
                "SELECT v.name, a.backend, a.type_name, a.type_id, g.address FROM allocations a "
                "JOIN hosts h ON h.id = a.host_id LEFT JOIN vms v ON v.id = a.vm_id "
                "LEFT JOIN gpus g ON g.id = a.gpu_id "
                "WHERE h.name = :h AND a.state IN :live ORDER BY a.id"
            ).bindparams(live), {"h": hostname, "live": list(LIVE_STATES)}).all()
            records = [(r[0], r[1], r[2], r[3], r[4]) for r in rows]
        if (state.ordinal or 0) >= 10:
            modes = {a: m for a, m in conn.execute(text(
                "SELECT b.address, b.vgpu_mode FROM gpu_boot_state b JOIN hosts h ON h.id = b.host_id "
                "WHERE h.name = :h AND b.vgpu_mode IS NOT NULL"), {"h": hostname}).all()}
    report = Report(hostname, schema.code_version(), {}, [h.as_dict() for h in hosts],
                    sorted({vm for vm, *_ in records if vm}), {}, {})
    _schema(report, state, hosts, hostname, engine.dialect.name)
    _fleet(report, hosts, hostname)
    _vms_kernel_driver(report, cfg, records, kernel, driver)
    say = lambda sev, area, msg: report.findings.append(Finding(sev, area, msg))  # noqa: E731
    report.gpus = upgrade_gpus.check(say, cfg, records, report.driver["running"], report.kernel["next"], driver,
                                     modes, guests, report.vms)
    return report


def _schema(report: Report, state: schema.State, hosts: list[schema.HostVersion], me: str, dialect: str) -> None:
    others = frozenset({me})
    plan = schema.plan(state, hosts, contract=True, ignore=others)
    expand_only = schema.plan(state, hosts, contract=False, ignore=others)
    report.schema = {"database": state.revision, "contract_level": state.contract_level,
                     "code": schema.SCHEMA_REVISION, **plan.as_dict()}
    say = report.findings.append
    if plan.ahead:
        try:
            schema.check(state, dialect=dialect)
        except SchemaMismatch as exc:
            say(Finding("block", "schema", exc.message))
            return
        say(Finding("info", "schema", f"the database ({state.revision}) is newer than this release "
                                      f"({schema.SCHEMA_REVISION}) and still serves it (contract level "
                                      f"{state.contract_level})"))
        return
    pending = [s for s in schema.steps() if s.ordinal > (state.ordinal or 0)]
    if not pending:
        say(Finding("info", "schema", f"the database is at this release's revision {schema.SCHEMA_REVISION}"))
        return
    for step in pending:
        if step in expand_only.apply:
            how = "SQLite: applied at the first command" if dialect == "sqlite" else "`vgpumgr db upgrade`"
            say(Finding("info", "schema", f"{step.revision} (expand, {how}): {step.doc}"))
        elif step.phase == "contract":
            old = plan.blockers.get(step.revision)
            held = (f"held back while {schema.who(old)} run(s) older code" if old else
                    "`vgpumgr db upgrade --contract` once every host runs "
                    "this release")
            say(Finding("warn", "schema", f"{step.revision} (contract, removes what code before "
                                          f"{step.min_code or 0:04d} needs): {held}: {step.doc}"))
        else:
            say(Finding("info", "schema", f"{step.revision} (expand, after the contract step before it): "
                                          f"{step.doc}"))


def _fleet(report: Report, hosts: list[schema.HostVersion], me: str) -> None:
    for h in hosts:
        if h.name == me or (h.version == report.version and h.schema == schema.code_ordinal()):
            continue
        when = "live" if h.live else "not seen lately"
        report.findings.append(Finding("info", "fleet", f"host {h.name} runs vgpumgr {h.version or 'unknown'} "
                                                        f"(schema {h.schema or 0:04d}, {when})"))


def _vms_kernel_driver(report: Report, cfg: Config, records: list[tuple[str | None, str, str | None, str, Any]],
                       kernel: str | None, driver: str | None) -> None:
    say = report.findings.append
    running = running_kernel(cfg)
    target = kernel or newest_installed_kernel(cfg) or running
    report.kernel = {"running": running, "next": target}
    if report.vms:
        say(Finding("warn", "vms", f"{len(report.vms)} VM(s) with vGPUs recorded here: {', '.join(report.vms)}; "
                                   "upgrading vgpumgr leaves them running, a kernel or driver change does not "
                                   "(`vgpumgr host drain` first)"))
    vendor_vf = [r for r in records if r[1] in VENDOR_VF_BACKENDS]
    t = kernel_tuple(target)
    if vendor_vf and t is not None and t < VENDOR_VF_KERNEL:
        say(Finding("block", "kernel", f"kernel {target} has no NVIDIA vendor-specific VF interface (6.8 or newer "
                                       f"needed) but {len(vendor_vf)} recorded vGPU(s) use it"))
    if target and running and target != running:
        sev = "block" if report.vms else "warn"
        say(Finding(sev, "kernel", f"the next boot runs kernel {target} (now {running}): VFs, vGPU types and mdevs "
                                   "are made again by `vgpumgr restore`" +
                    (f"; {len(report.vms)} VM(s) still run here" if report.vms else "")))
    now = nvidia_driver(cfg)
    report.driver = {"running": now, "next": driver or now}
    if driver and now and driver != now:
        types = sorted({r[2] or r[3] for r in records})
        branch_change = driver.split(".")[0] != now.split(".")[0]
        sev = "block" if report.vms else ("warn" if branch_change else "info")
        msg = f"NVIDIA host driver {now} -> {driver}"
        if branch_change:
            msg += (": a new branch; check that it offers the recorded vGPU types "
                    f"({', '.join(types) or 'none recorded'}) and that the guests' drivers are supported with it")
        if report.vms:
            msg += f"; unloading the driver stops {len(report.vms)} running vGPU VM(s)"
        say(Finding(sev, "driver", msg))
