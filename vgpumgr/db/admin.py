"""`vgpumgr db upgrade|current|backup|restore`: the schema changed on purpose, and copies that restore."""

from __future__ import annotations

import os
import sqlite3
import tempfile
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
from vgpumgr.errors import AuditBroken, Conflict, InvalidInput, NotFound, SchemaMismatch


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
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as raw:
            revision = raw.execute("SELECT version_num FROM alembic_version").fetchone()[0]
    except (sqlite3.DatabaseError, TypeError) as exc:
        raise InvalidInput(f"{path} is not a vgpumgr SQLite database ({exc})",
                           hint="name a file written by `vgpumgr db backup`") from exc
    url = f"sqlite:///{path}"
    try:
        with session_factory(url)() as s:
            result = audit.verify(s)
    finally:
        dispose_engine(url)
    if not result.ok:
        first = result.problems[0]
        raise AuditBroken(f"the audit chain of {path} does not verify: event {first.seq}: {first.reason}",
                          hint="this copy was altered or is damaged; use another backup (or `--force` to take it "
                               "as it is, audited as such)")
    return Copy(str(path), revision, result.checked, result.head_seq, path.stat().st_size)


def backup(url: str, dest: Path, *, force: bool = False) -> Copy:
    """SQLite's online backup API: a consistent copy while the service keeps writing (the write-ahead log
    included, which a `cp` of the database file misses), made beside `dest` and renamed into place once its
    audit chain verifies; 0600."""
    src = _sqlite_path(url, "backup")  # copied as it is: a backup before `db upgrade` must keep the old schema
    if not src.is_file():
        raise NotFound(f"there is no database at {src}", hint="check --db / VGPUMGR_DB")
    dest = dest.absolute()
    if dest.exists() and not force:
        raise Conflict(f"{dest} exists", hint="name a new file, or add --force to replace it")
    if not dest.parent.is_dir():
        raise NotFound(f"the directory {dest.parent} does not exist", hint="create it, or name another file")
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o600)
        with closing(sqlite3.connect(src)) as live, closing(sqlite3.connect(tmp)) as out:
            live.backup(out)
        copy = verified(Path(tmp))
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    copy.path = str(dest)
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
