"""Engines, sessions and schema migrations.

SQLite gets WAL (readers never wait for the writer), a busy timeout, foreign keys, and
`BEGIN IMMEDIATE` for every transaction: a transaction that starts by reading and later writes
cannot then fail with "database is locked" halfway, and audit appends are serialized. PostgreSQL
needs none of this; it is used as given by its URL.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

from vgpumgr.db import schema
from vgpumgr.errors import InvalidInput, Unavailable
from vgpumgr.hostfs.locking import state_dir

DB_FILE = "vgpumgr.db"
SQLITE_BUSY_TIMEOUT_MS = 30_000
MIGRATIONS_DIR = schema.MIGRATIONS_DIR
SCHEMA_REVISION = schema.SCHEMA_REVISION

PING_AFTER_IDLE_S = 1.0  # a pooled server connection idle longer than this is checked before use
READ_ONLY = "vgpumgr_read_only"  # execution option: a transaction that only reads

_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()
_schema_ready: set[str] = set()
_schema_lock = threading.Lock()


def default_db_url() -> str:
    """$VGPUMGR_DB, else SQLite in the state dir (/var/lib/vgpumgr as root, else the user's state dir)."""
    env = os.environ.get("VGPUMGR_DB")
    if env:
        return env
    return f"sqlite:///{state_dir() / DB_FILE}"


def _check_url(url: str) -> Any:
    try:
        parsed = make_url(url)
    except Exception as exc:  # sqlalchemy raises ArgumentError, but be tolerant of odd input
        raise InvalidInput(f"'{url}' is not a database URL",
                           hint="use sqlite:////path/to/vgpumgr.db or postgresql://user@host/dbname") from exc
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise InvalidInput(f"database '{parsed.get_backend_name()}' is not supported",
                           hint="use a sqlite:/// or postgresql:// URL")
    return parsed


def driver_url(url: str) -> Any:
    """The URL SQLAlchemy is given. A bare `postgresql://` means psycopg 3, the driver vgpumgr depends on,
    whichever SQLAlchemy is installed (2.0 would pick psycopg2, 2.1 picks psycopg): the README's URL works from
    a plain install. `postgresql+psycopg2://` still selects psycopg2 where it is installed."""
    parsed = _check_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def _driver_missing(parsed: Any, exc: ImportError) -> Unavailable:
    module = getattr(exc, "name", None) or str(exc)
    return Unavailable(f"the database driver for {parsed.drivername}:// is not installed ({module})",
                       hint="use postgresql:// (psycopg 3, installed with vgpumgr), or install the driver named "
                            "(e.g. `pip install psycopg2-binary` for postgresql+psycopg2://)")


def _sqlite_setup(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # let SQLAlchemy's "begin" hook issue BEGIN itself
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA journal_mode = WAL")
        # In WAL mode NORMAL stays consistent after a crash; only the last commits may be lost on power loss.
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # A read-only unit (see `read_sessions`) takes no write lock: in WAL it never waits for the writer.
        # On the driver connection itself: exec_driver_sql would cost ~35 us of SQLAlchemy's execution
        # machinery per transaction (four per allocate+release).
        begin = "BEGIN" if conn.get_execution_options().get(READ_ONLY) else "BEGIN IMMEDIATE"
        conn.connection.driver_connection.execute(begin)


def make_engine(url: str | None = None, **kwargs: Any) -> Engine:
    """A new engine for `url` (default: default_db_url()), with the SQLite settings applied."""
    url = url or default_db_url()
    parsed = driver_url(url)
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database
        if db and db != ":memory:" and not db.startswith("file:"):
            Path(db).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, **kwargs)
        _sqlite_setup(engine)
        return engine
    if parsed.get_backend_name() == "postgresql" and "client_encoding" not in parsed.query:
        # A database created SQL_ASCII (initdb under LANG=C or POSIX) hands psycopg bytes for every text value
        # unless the client asks for UTF8, and SQLAlchemy's first connect then fails parsing the server's version.
        kwargs["connect_args"] = {"client_encoding": "utf8", **kwargs.get("connect_args", {})}
    try:
        engine = create_engine(parsed, **kwargs)
    except ImportError as exc:
        raise _driver_missing(parsed, exc) from exc
    if not kwargs.get("pool_pre_ping"):
        _ping_after_idle(engine)
    return engine


def _ping_after_idle(engine: Engine) -> None:
    """Check a pooled server connection before use only when it sat idle for PING_AFTER_IDLE_S.

    SQLAlchemy's pool_pre_ping would cost a round trip on every checkout: four per allocate+release
    (`scripts/bench_allocate.py --db postgresql`). A connection in steady use was just proven alive; one that
    sat idle may have been cut by a server restart or an idle timeout, and is then replaced before use."""

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("idle_since")
        if since is None or time.monotonic() - since < PING_AFTER_IDLE_S:
            return
        try:
            cur = dbapi_conn.cursor()
            cur.execute("SELECT 1")
            cur.close()
        except Exception as exc:  # noqa: BLE001 - any failure means: use another connection
            raise DisconnectionError("pooled connection is gone") from exc  # the pool retries with a new one


def get_engine(url: str | None = None) -> Engine:
    """The process-wide engine for `url` (created once)."""
    url = url or default_db_url()
    with _engines_lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _engines[url] = make_engine(url)
        return engine


def dispose_engine(url: str) -> None:
    """Close the pooled connections of one cached engine (e.g. before dropping its database)."""
    with _engines_lock:
        engine = _engines.pop(url, None)
    if engine is not None:
        engine.dispose()


def checkpoint_sqlite() -> None:
    """PASSIVE checkpoint of every SQLite database this process opened (never waits for a writer; a failure is
    only a missed copy: the log still holds the commits)."""
    with _engines_lock:
        engines = [e for e in _engines.values() if e.dialect.name == "sqlite"]
    for engine in engines:
        try:
            raw = engine.raw_connection()
            try:
                raw.driver_connection.execute("PRAGMA wal_checkpoint(PASSIVE)")
            finally:
                raw.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            continue


def dispose_engines() -> None:
    with _engines_lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


def session_factory(url_or_engine: str | Engine | None = None) -> sessionmaker[Session]:
    """Sessions whose objects stay usable after commit (the service hands rows on to the caller)."""
    engine = url_or_engine if isinstance(url_or_engine, Engine) else get_engine(url_or_engine)
    return sessionmaker(bind=engine, expire_on_commit=False)


class ReadSession(Session):
    """A session that only reads: its transaction ends with COMMIT when the block ends without an error (for a
    transaction that wrote nothing the same as a rollback). psycopg 3 discards every statement it prepared on the
    connection at each ROLLBACK (and sends DEALLOCATE ALL): a lookup ended by rollback made the next change plan
    its publishing statement again (~0.7 ms on the server) and cost a round trip more."""

    _wrote = False

    def flush(self, objects: Any = None) -> None:
        # a lookup that wrongly changed an object must not make it stick: such a session ends in a rollback
        self._wrote = self._wrote or bool(self.new or self.dirty or self.deleted)
        super().flush(objects)

    def __exit__(self, type_: Any, value: Any, traceback: Any) -> None:
        wrote = self._wrote or bool(self.new or self.dirty or self.deleted)
        if type_ is None and not wrote and self.in_transaction():
            self.commit()
        super().__exit__(type_, value, traceback)


@contextmanager
def reading(engine: Engine) -> Iterator[Connection]:
    """A connection for a lookup outside a Session (the REST token check, the schema check on each heartbeat):
    read-only, and ended by COMMIT when the block ends without an error, for the reason ReadSession gives. Ended
    by rollback, as `engine.connect()` ends, the REST service's token check every LOOKUP_TTL made the next `fleet
    place` on that pooled connection plan its statements again."""
    with engine.connect().execution_options(**{READ_ONLY: True}) as conn:
        yield conn
        if conn.in_transaction():
            conn.commit()


def read_sessions(url_or_engine: str | Engine | None = None) -> sessionmaker[Session]:
    """Sessions for reading only: on SQLite a plain (deferred) BEGIN instead of BEGIN IMMEDIATE, so a
    lookup neither takes nor waits for the database's write lock. Writing through one is a mistake."""
    engine = url_or_engine if isinstance(url_or_engine, Engine) else get_engine(url_or_engine)
    return sessionmaker(bind=engine.execution_options(**{READ_ONLY: True}), expire_on_commit=False,
                        class_=ReadSession)


def _alembic_config(engine: Engine) -> Any:
    from alembic.config import Config

    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise InvalidInput(f"the migrations directory {MIGRATIONS_DIR} is missing",
                           hint="reinstall vgpumgr from its source tree")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def _run(url_or_engine: str | Engine | None, fn: Any, *args: Any) -> None:
    """An Alembic command in one transaction; on PostgreSQL under an advisory lock (two hosts upgrading at once:
    the second waits, then finds the work done)."""
    engine = url_or_engine if isinstance(url_or_engine, Engine) else get_engine(url_or_engine)
    with engine.begin() as conn:
        lock_schema(conn)
        alembic_on(conn, fn, *args)


def lock_schema(conn: Any) -> None:
    """Serialise schema changes across a fleet: a PostgreSQL advisory lock held until the transaction ends."""
    from sqlalchemy import text

    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": schema.LOCK_KEY})


def alembic_on(conn: Any, fn: Any, *args: Any) -> None:
    """Run an Alembic command on `conn` (its transaction); then set the contract level from the revision reached."""
    from sqlalchemy import text

    cfg = _alembic_config(conn.engine)
    cfg.attributes["connection"] = conn
    fn(cfg, *args)
    revision = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    if (schema.ordinal(revision) or 0) >= 9:
        conn.execute(text("UPDATE vgpumgr_schema SET contract_level = :l WHERE id = 1"),
                     {"l": schema.contract_level_at(revision)})


def upgrade(url: str | Engine | None = None, rev: str = "head") -> None:
    """Bring the schema to `rev` (default: the newest), contract steps included: what a single host (SQLite)
    and the tests do. A fleet's `vgpumgr db upgrade` goes through vgpumgr.db.schema's plan instead."""
    from alembic import command

    _run(url, command.upgrade, rev)


def downgrade(url: str | Engine | None, rev: str) -> None:
    """Take the schema back to `rev` ("base" drops everything vgpumgr created)."""
    from alembic import command

    _run(url, command.downgrade, rev)


def current_revision(url: str | Engine | None = None) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = url if isinstance(url, Engine) else get_engine(url)
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()


def ensure_schema(url: str) -> None:
    """Check the schema once per process (one query when it is this code's own revision). A new SQLite database
    gets the newest schema from its SQL snapshot (vgpumgr.db.snapshot) without Alembic; an older SQLite one is
    upgraded (one host); a PostgreSQL one is never changed here (vgpumgr.db.schema.check says what to do), except
    a database without any schema, which is created."""
    with _schema_lock:
        if url in _schema_ready:
            return
        state = stored_state(url)
        if state is None:
            if not _from_snapshot(url):
                upgrade(url)
        elif schema.check(state, dialect=get_engine(url).dialect.name) == "upgrade":
            upgrade(url)
        _schema_ready.add(url)


def forget_schema(url: str) -> None:
    """Check `url`'s schema again at the next ensure_schema (after `db upgrade`, `db restore`)."""
    with _schema_lock:
        _schema_ready.discard(url)


def _from_snapshot(url: str) -> bool:
    engine = get_engine(url)
    if engine.dialect.name != "sqlite":
        return False
    from vgpumgr.db.snapshot import create_if_empty

    return create_if_empty(engine, SCHEMA_REVISION)


def stored_state(url: str) -> schema.State | None:
    """The database's revision and contract level, or None when it has no schema yet. A server that cannot be
    reached, or refuses us, is Unavailable (exit 8), not a missing schema."""
    from sqlalchemy.exc import DBAPIError, OperationalError

    engine = get_engine(url)
    try:
        with reading(engine) as conn:
            return schema.read_state(conn)
    except ImportError as exc:
        raise _driver_missing(engine.url, exc) from exc
    except (OperationalError, DBAPIError) as exc:
        if _no_table(exc):
            return None
        raise unreachable(engine, exc) from exc


def server_encoding(engine: Engine) -> str | None:
    """PostgreSQL's server_encoding of the database (UTF8; SQL_ASCII stores bytes unchecked)."""
    from sqlalchemy import text

    with engine.connect().execution_options(**{READ_ONLY: True}) as conn:
        value = conn.execute(text("SHOW server_encoding")).scalar()
    return value.decode() if isinstance(value, bytes) else value


def stored_revision(url: str) -> str | None:
    """The database's revision read with one query (no Alembic), or None when it has no schema yet."""
    state = stored_state(url)
    return state.revision if state else None


def unreachable(engine: Engine | None, exc: BaseException) -> Unavailable:
    where = f" {engine.url.render_as_string(hide_password=True)}" if engine is not None else ""
    first = str(getattr(exc, "orig", exc)).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return Unavailable(f"cannot use the database{where}: {first}",
                       hint="check that the server runs and the URL (VGPUMGR_DB or --db) names it, its user and "
                            "database; for SQLite, that the directory is writable")


def _no_table(exc: BaseException) -> bool:
    text = str(getattr(exc, "orig", exc)).lower()
    return "no such table" in text or ("does not exist" in text and "relation" in text)
