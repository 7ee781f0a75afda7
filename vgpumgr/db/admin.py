"""`vgpumgr db upgrade|downgrade|current|backup|restore`: the schema changed on purpose, and copies that restore."""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpumgr.db import schema
from vgpumgr.db.models import utcnow
from vgpumgr.db.session import (
    alembic_on,
    ensure_schema,
    forget_schema,
    get_engine,
    lock_schema,
    session_factory,
    stored_state,
)
from vgpumgr.errors import AuditBroken, InvalidInput, NotFound, SchemaMismatch


def upgrade(url: str, *, contract: bool = False, ignore: frozenset[str] = frozenset(), me: str = "",
            dry_run: bool = False) -> schema.Plan:
    """Apply what schema.plan allows, in one transaction under the schema lock (PostgreSQL: the plan is made
    again once the lock is held, so two hosts upgrading at once do the work once). SQLite is one host's own
    database: its contract steps need no --contract."""
    from alembic import command

    engine = get_engine(url)
    sqlite = engine.dialect.name == "sqlite"
    with engine.begin() as conn:
        lock_schema(conn)
        state = _state(conn)
        hosts = schema.host_versions(conn, utcnow()) if (state.ordinal or 0) >= 9 else []
        plan = schema.plan(state, hosts, contract=contract or sqlite, ignore=ignore | {me})
        if plan.ahead:
            schema.check(state, dialect=engine.dialect.name)  # raises when this code may not use it
        elif plan.apply and not dry_run:
            alembic_on(conn, command.upgrade, plan.target)
    forget_schema(url)
    return plan


def _state(conn: Any) -> schema.State:
    from sqlalchemy.exc import DBAPIError

    try:
        with conn.begin_nested():
            return schema.read_state(conn)
    except DBAPIError:  # no alembic_version yet: an empty database
        return schema.State(None)


# -- downgrade: only to a revision of this vgpumgr's own chain, a backup first, the loss confirmed ---------------
BASE = "base"
_CREATED = re.compile(r"create_table\(\s*[\"'](\w+)[\"']")


@dataclass
class Downgrade:
    """What `db downgrade` undoes: the steps (newest first), the tables they drop with their rows now."""

    current: str | None
    target: str
    steps: list[schema.Step]
    dropped: dict[str, int]  # table -> rows it holds now
    backup: str | None = None
    done: bool = False

    @property
    def audit_events(self) -> int | None:
        return self.dropped.get("audit_events")

    def as_dict(self) -> dict[str, Any]:
        return {"current": self.current, "target": self.target, "steps": [s.as_dict() for s in self.steps],
                "dropped_tables": self.dropped, "backup": self.backup, "done": self.done}


def known_revisions() -> list[str]:
    return [BASE, *(s.revision for s in schema.steps())]


def downgrade_plan(url: str, revision: str) -> Downgrade:
    """Pure reading: refused (InvalidInput, exit 2) unless `revision` is `base` or a revision of this vgpumgr's own
    chain older than the database's, and the database's revision is one this code knows (it can only undo steps
    it has the code of)."""
    known = known_revisions()
    if revision not in known:
        raise InvalidInput(f"'{revision[:80]}' is not a schema revision of this vgpumgr; nothing was changed",
                           hint=f"the revisions it knows: {', '.join(known)} (`vgpumgr db current` shows the "
                                "database's)")
    state = stored_state(url)
    if state is None or state.revision is None:
        raise InvalidInput("the database has no schema: there is nothing to downgrade")
    mine = {s.revision: s for s in schema.steps()}
    if state.revision not in mine:
        raise InvalidInput(f"the database is at schema revision {state.revision}, which this vgpumgr "
                           f"({schema.code_version()}) has no code for; it cannot undo it",
                           hint="downgrade with the vgpumgr release that made that revision")
    at, to = mine[state.revision].ordinal, 0 if revision == BASE else mine[revision].ordinal
    if to > at:
        raise InvalidInput(f"{revision} is newer than the database's revision {state.revision}",
                           hint="`vgpumgr db upgrade` brings the schema forward")
    undone = [s for s in reversed(schema.steps()) if to < s.ordinal <= at]
    return Downgrade(state.revision, revision, undone, _row_counts(url, _tables_created(undone)))


def _tables_created(steps: list[schema.Step]) -> list[str]:
    names: list[str] = []
    for step in steps:
        for path in (schema.MIGRATIONS_DIR / "versions").glob(f"{step.ordinal:04d}_*.py"):
            names += _CREATED.findall(path.read_text())
    return names


def _row_counts(url: str, tables: list[str]) -> dict[str, int]:
    from sqlalchemy import inspect, text

    with get_engine(url).connect() as conn:
        present = set(inspect(conn).get_table_names())
        return {t: int(conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar() or 0)  # noqa: S608 - own names
                for t in tables if t in present}


def downgrade(url: str, plan: Downgrade, *, backup_to: Path | None, actor: str, host: str) -> Downgrade:
    """Carry out `plan` (from downgrade_plan, confirmed by the caller): an audit event first (it is in the backup
    even when the audit trail itself is dropped), then the backup (SQLite: `backup_to`; PostgreSQL: None, the
    operator's pg_dump), then the steps in one transaction."""
    from vgpumgr.audit import chain as audit
    from vgpumgr.db.session import downgrade as run_downgrade

    if not plan.steps:
        return plan
    detail = {"from": plan.current, "to": plan.target, "dropped_tables": plan.dropped,
              "backup": str(backup_to) if backup_to else None}
    with session_factory(url).begin() as s:
        audit.record(s, actor=actor, action="db.downgrade", outcome="warning", host=host, detail=detail)
    plan.dropped = _row_counts(url, list(plan.dropped))  # with that event: what the backup holds
    if backup_to is not None:
        plan.backup = backup(url, backup_to).path
    run_downgrade(url, plan.target)
    forget_schema(url)
    plan.done = True
    return plan


@dataclass
class Current:
    revision: str | None
    contract_level: int
    code_revision: str
    code_version: str
    compatible: bool
    reason: str | None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def current(url: str) -> Current:
    state = stored_state(url)
    reason = None
    try:
        if state is not None:
            schema.check(state, dialect=get_engine(url).dialect.name)
    except SchemaMismatch as exc:  # reported, not raised
        reason = str(exc)
    return Current(state.revision if state else None, state.contract_level if state else 0, schema.SCHEMA_REVISION,
                   schema.code_version(), reason is None, reason)


# -- backups (SQLite) ------------------------------------------------------------------------------------------
@dataclass
class Copy:
    path: str
    revision: str | None
    events: int
    head_seq: int
    size: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _sqlite_path(url: str, verb: str) -> Path:
    engine = get_engine(url)
    if engine.dialect.name != "sqlite":
        tool = "pg_dump --format=custom --file FILE" if verb == "backup" else "pg_restore --clean --dbname URL FILE"
        raise InvalidInput(f"`vgpumgr db {verb}` copies SQLite databases; this one is PostgreSQL",
                           hint=f"use PostgreSQL's own tools: {tool} (README, 'Backups')")
    db = engine.url.database
    if not db or db == ":memory:":
        raise InvalidInput("an in-memory database has nothing to back up or restore", hint="use a file URL")
    return Path(db)


def verified(path: Path) -> Copy:
    """Open an SQLite copy read-only, check that it is a vgpumgr database, and walk its audit chain."""
    from vgpumgr.audit import chain as audit
    from vgpumgr.db.session import dispose_engine

    if not path.is_file():
        raise NotFound(f"{path} does not exist", hint="name the backup file written by `vgpumgr db backup`")
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as raw:  # closed: no lock outlives it
            revision = raw.execute("SELECT version_num FROM alembic_version").fetchone()[0]
            journal = raw.execute("PRAGMA journal_mode").fetchone()[0]
    except (sqlite3.DatabaseError, TypeError) as exc:
        raise InvalidInput(f"{path} is not a vgpumgr SQLite database ({exc})",
                           hint="name a file written by `vgpumgr db backup`") from exc
    url = f"sqlite:///{path}"
    try:
        with session_factory(url)() as s:
            result = audit.verify(s)
    finally:
        dispose_engine(url)
        if journal != "wal":  # the engine made it a WAL database: back as it was, no -wal/-shm left beside it
            with closing(sqlite3.connect(path)) as conn:
                conn.execute(f"PRAGMA journal_mode={journal}").fetchall()
    if not result.ok:
        first = result.problems[0]
        raise AuditBroken(f"the audit chain of {path} does not verify: event {first.seq}: {first.reason}",
                          hint="this copy was altered or is damaged; use another backup (or `--force` to take it "
                               "as it is, audited as such)")
    return Copy(str(path), revision, result.checked, result.head_seq, path.stat().st_size)


def backup(url: str, dest: Path, *, force: bool = False) -> Copy:
    """SQLite's online backup API: a consistent copy while the service keeps writing (the write-ahead log
    included, which a `cp` of the database file misses), made beside `dest` and renamed into place once its
    audit chain verifies; 0600, in rollback-journal mode, nothing else left beside it (vgpumgr.userinput.files)."""
    from vgpumgr.userinput import files

    src = _sqlite_path(url, "backup")  # copied as it is: a backup before `db upgrade` must keep the old schema
    if not src.is_file():
        raise NotFound(f"there is no database at {src}", hint="check --db / VGPUMGR_DB")
    with files.atomic_target(dest, what="db backup", replace=force, mode=0o600) as tmp:
        with closing(sqlite3.connect(src)) as live, closing(sqlite3.connect(tmp)) as out:
            live.backup(out)
        with closing(sqlite3.connect(tmp)) as out:  # a WAL database keeps -wal/-shm files named after tmp
            out.execute("PRAGMA journal_mode=DELETE").fetchall()
        copy = verified(tmp)
    copy.path = str(Path(dest).absolute())
    return copy


def restore(url: str, source: Path, *, force: bool = False,
            record: Callable[[Path], Any] | None = None) -> tuple[Copy, Path]:
    """Replace this host's SQLite database with a backup: the backup's audit chain verified first (refused when it
    does not, unless `force`), its schema one this code can use, the current database kept beside it
    (`<db>.before-restore`, or `.before-restore.N` where an earlier restore's is kept), the copy made with the backup
    API (other connections see the whole new content). `record(kept)` then writes the restore's signed audit
    record; should it fail, the kept database is put back."""
    target = _sqlite_path(url, "restore")
    try:
        copy = verified(source)
    except AuditBroken:
        if not force:
            raise
        copy = Copy(str(source), None, -1, -1, source.stat().st_size)
    with closing(sqlite3.connect(f"file:{source}?mode=ro", uri=True)) as raw:
        revision = raw.execute("SELECT version_num FROM alembic_version").fetchone()[0]
        level = 0
        if (schema.ordinal(revision) or 0) >= 9:
            level = raw.execute("SELECT contract_level FROM vgpumgr_schema WHERE id = 1").fetchone()[0]
    schema.check(schema.State(revision, level), dialect="sqlite")  # raises if this code cannot use it
    kept = next(p for n in range(1, 1000) if not (p := target.with_name(
        target.name + ".before-restore" + (f".{n}" if n > 1 else ""))).exists())  # a signed record may name it
    target.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(target)) as live:
        with closing(sqlite3.connect(kept)) as old:
            live.backup(old)
        with closing(sqlite3.connect(f"file:{source}?mode=ro", uri=True)) as src:
            src.backup(live)
    os.chmod(kept, 0o600)
    forget_schema(url)
    try:
        ensure_schema(url)  # an older backup is brought to this code's revision
        if record is not None:
            record(kept)
    except BaseException:
        with closing(sqlite3.connect(kept)) as old, closing(sqlite3.connect(target)) as live:
            old.backup(live)
        forget_schema(url)
        kept.unlink()
        raise
    return copy, kept
