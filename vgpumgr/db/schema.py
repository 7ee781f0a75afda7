"""Rolling upgrades: which database schemas this vgpumgr works with, and what `db upgrade` may do.

Every migration declares its `phase`:
- "expand": additive (new tables, nullable or defaulted columns, indexes); code one release older keeps
  working on the result, so a fleet can run both releases against one database while it upgrades host by host;
- "contract": a removal. It names `contract_min_code`, the first revision whose code no longer needs what it
  removes; applying it raises the database's *contract level* (`vgpumgr_schema.contract_level`) to that
  revision's ordinal, and code that knows only older revisions then stops with SchemaMismatch.

Revision ids begin with their ordinal (`0009_rolling_upgrades` is 9), so code can place a revision it has never
seen. A vgpumgr whose newest revision has ordinal N, opening a database at revision R:
- R == N: the everyday case (one query, no Alembic);
- R > N: a newer host ran expand steps; fine while the contract level is <= N, else SchemaMismatch (exit 11);
- R < N: SQLite (one host) upgrades itself; PostgreSQL (a fleet) is changed only by an explicit
  `vgpumgr db upgrade`, so SchemaMismatch says to run it when an expand step is pending (pending contract steps
  need nothing of this code: they wait until every host runs it). So a release puts its contract steps after its
  expand steps, and a fleet upgrades one release at a time.
- no schema yet: created.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from vgpumgr.errors import SchemaMismatch
from vgpumgr.resources import data_dir

MIGRATIONS_DIR = data_dir("migrations")
# The newest migration. Stamped here so that a start can compare it with the database's revision
# without loading Alembic (~100 ms); tests/test_db.py checks it against Alembic's head.
SCHEMA_REVISION = "0018_fleet_best_fit"

LOCK_KEY = 0x76677075  # pg_advisory_xact_lock key of schema changes ("vgpu")
LIVE_WINDOW = timedelta(hours=24)  # a host seen this recently counts as running its recorded code
_ORDINAL = re.compile(r"^(\d{4})(?:_|$)")


def ordinal(revision: str | None) -> int | None:
    """9 for "0009_rolling_upgrades"; None for no revision or one not named by this convention."""
    m = _ORDINAL.match(revision or "")
    return int(m.group(1)) if m else None


@cache
def code_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vgpumgr")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


@dataclass(frozen=True)
class Step:
    revision: str
    ordinal: int
    phase: str  # "expand" | "contract"
    min_code: int | None  # contract: the first code ordinal that no longer needs what it removes
    doc: str

    def as_dict(self) -> dict[str, Any]:
        return {"revision": self.revision, "phase": self.phase, "min_code": self.min_code, "doc": self.doc}


@cache
def steps() -> tuple[Step, ...]:
    """This release's migrations, oldest first, with their phases (read from the revision files)."""
    found = []
    for path in sorted((MIGRATIONS_DIR / "versions").glob("[0-9][0-9][0-9][0-9]_*.py")):
        spec = importlib.util.spec_from_file_location(f"_vgpumgr_rev_{path.stem}", path)
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        phase = getattr(mod, "phase", None)
        if phase not in ("expand", "contract"):
            raise SchemaMismatch(f"migration {path.name} declares no phase (expand or contract)",
                                 hint="this installation is damaged: reinstall vgpumgr")
        min_code = ordinal(getattr(mod, "contract_min_code", None)) if phase == "contract" else None
        doc = (mod.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        found.append(Step(mod.revision, ordinal(mod.revision) or 0, phase, min_code, doc))
    return tuple(found)


def code_ordinal() -> int:
    return ordinal(SCHEMA_REVISION) or 0


def contract_level_at(revision: str | None) -> int:
    """The contract level a database at `revision` has: the highest min_code of the contract steps up to it."""
    at = ordinal(revision) or 0
    return max((s.min_code or 0 for s in steps() if s.phase == "contract" and s.ordinal <= at), default=0)


@dataclass
class State:
    revision: str | None
    contract_level: int = 0

    @property
    def ordinal(self) -> int | None:
        return ordinal(self.revision)


def read_state(conn: Any) -> State:
    """The database's revision and contract level, on an open SQLAlchemy connection."""
    from sqlalchemy import text

    revision = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    level = 0
    if (ordinal(revision) or 0) >= 9:
        level = conn.execute(text("SELECT contract_level FROM vgpumgr_schema WHERE id = 1")).scalar() or 0
    return State(revision, int(level))


def check(state: State, *, dialect: str) -> str:
    """What to do on opening a database in `state`: "ok", "upgrade" (SQLite behind: upgrade it) or raise
    SchemaMismatch with the way out."""
    mine = code_ordinal()
    theirs = state.ordinal
    if state.revision == SCHEMA_REVISION:
        return "ok"
    if theirs is None:
        raise SchemaMismatch(
            f"the database is at schema revision '{state.revision}', which this vgpumgr ({code_version()}) "
            "cannot place", hint="it was made by another program or a vgpumgr too old for rolling upgrades "
            "(before 0009); see the README's 'Upgrading' section")
    if theirs > mine:
        if state.contract_level > mine:
            raise SchemaMismatch(
                f"this host's vgpumgr {code_version()} knows schema revisions up to {SCHEMA_REVISION}, but the "
                f"database is at {state.revision} and has been contracted: it needs vgpumgr code of schema "
                f"revision {state.contract_level:04d} or newer",
                hint="upgrade vgpumgr on this host to the release the other hosts run (`vgpumgr upgrade check` "
                     "with the new release shows what it will do), then restart vgpumgr.service")
        return "ok"  # a newer host expanded the schema; what this code uses is all still there
    if dialect == "sqlite":
        return "upgrade"
    pending = [s.revision for s in steps() if (theirs or 0) < s.ordinal <= mine and s.phase == "expand"]
    if not pending:  # only contract steps left: they wait until every host runs this release, and it needs them not
        return "ok"
    raise SchemaMismatch(
        f"the database is at schema revision {state.revision}; this vgpumgr {code_version()} needs "
        f"{SCHEMA_REVISION} ({len(pending)} step(s) pending: {', '.join(pending)})",
        hint="run `vgpumgr db upgrade` once (on any upgraded host): expand steps only, hosts still on the older "
             "vgpumgr keep working; `vgpumgr upgrade check` shows the plan")


@dataclass
class HostVersion:
    name: str
    version: str | None
    schema: int | None
    last_seen: datetime | None
    live: bool

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.name, "version": self.version, "schema": self.schema,
                "last_seen": self.last_seen.isoformat() if self.last_seen else None, "live": self.live}


def who(hosts: list[HostVersion]) -> str:
    return ", ".join(f"{h.name} (vgpumgr {h.version or 'unknown'})" for h in hosts)


def host_versions(conn: Any, now: datetime, window: timedelta = LIVE_WINDOW) -> list[HostVersion]:
    """Every host the database knows, with the code it last ran; live = seen within `window` (its last command
    or its service's fleet heartbeat)."""
    from sqlalchemy import text

    rows = conn.execute(text(
        "SELECT h.name, h.code_version, h.code_schema, h.last_seen, f.heartbeat_at FROM hosts h "
        "LEFT JOIN fleet_hosts f ON f.host_id = h.id ORDER BY h.name")).all()
    out = []
    for name, version, schema, last_seen, beat in rows:
        seen = max((_aware(t) for t in (last_seen, beat) if t is not None), default=None)
        out.append(HostVersion(name, version, schema, seen, seen is not None and now - seen <= window))
    return out


def _aware(value: Any) -> datetime:
    from datetime import UTC

    if isinstance(value, str):  # SQLite through text(): SQLAlchemy's stored form
        value = datetime.fromisoformat(value)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


@dataclass
class Plan:
    """What `db upgrade` would do now: the steps it applies, and the contract steps it holds back and why."""

    current: str | None
    target: str | None
    apply: list[Step] = field(default_factory=list)
    held: list[Step] = field(default_factory=list)
    blockers: dict[str, list[HostVersion]] = field(default_factory=dict)  # contract revision -> old live hosts
    ahead: bool = False  # the database is newer than this code

    def as_dict(self) -> dict[str, Any]:
        return {"current": self.current, "target": self.target, "ahead": self.ahead,
                "apply": [s.as_dict() for s in self.apply], "held": [s.as_dict() for s in self.held],
                "blockers": {k: [h.as_dict() for h in v] for k, v in self.blockers.items()}}


def plan(state: State, hosts: list[HostVersion], *, contract: bool, ignore: frozenset[str] = frozenset()) -> Plan:
    """Pure: the steps after `state` that `db upgrade` applies. Expand steps always; a contract step only with
    `contract`, and only while no live host (other than those in `ignore`) runs code older than its min_code.
    The chain is linear, so the first contract step held back holds back every step after it."""
    current = state.ordinal or 0
    p = Plan(state.revision, state.revision, ahead=current > code_ordinal())
    for step in steps():
        if step.ordinal <= current:
            continue
        if p.held:
            p.held.append(step)
            continue
        if step.phase == "contract":
            old = [h for h in hosts if h.live and h.name not in ignore and (h.schema or 0) < (step.min_code or 0)]
            if not contract or old:
                p.held.append(step)
                if old:
                    p.blockers[step.revision] = old
                continue
        p.apply.append(step)
        p.target = step.revision
    return p
