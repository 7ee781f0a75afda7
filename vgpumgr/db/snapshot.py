"""The newest schema of an SQLite database as SQL, for a start on a new database without loading Alembic.

`alembic upgrade head` on an empty SQLite file costs ~0.2 s of every first start (Alembic, Mako and the
DDL modules of five databases are imported, every migration is compiled and run) and leaves a schema that
is always the same: migrations/sqlite-head.sql holds it, statement by statement, with the rows the
migrations write (the revision, the audit chain's head). `create_if_empty` runs it on a database without
tables, in one transaction; anything else (an older schema, PostgreSQL, a snapshot of another revision)
goes through Alembic as before. tests/test_db.py builds one database each way and compares them; after a
new migration, write the snapshot again:

    .venv/bin/python scripts/schema_snapshot.py        # rewrites migrations/sqlite-head.sql
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from vgpumgr.resources import data_dir

FILE = "sqlite-head.sql"
_HEADER = "-- vgpumgr schema at revision {rev}: what `alembic upgrade head` leaves in an empty SQLite database.\n"
_HINT = "-- Written by `scripts/schema_snapshot.py`; tests/test_db.py checks it against the migrations.\n"

TYPE_CHECKING = False
if TYPE_CHECKING:
    from sqlalchemy import Engine


def path() -> Path:
    return data_dir("migrations") / FILE


def dump(conn: sqlite3.Connection, revision: str) -> str:
    """The schema objects in the order they were made, then every row of every table, as SQL text."""
    objects = conn.execute("SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE "
                           "'sqlite_%' ORDER BY rowid").fetchall()
    lines = [_HEADER.format(rev=revision), _HINT]
    lines += [f"{sql};\n" for _, _, sql in objects]
    for kind, name, _ in objects:
        if kind != "table":
            continue
        columns = [row[1] for row in conn.execute(f'PRAGMA table_info("{name}")')]
        quoted = " || ',' || ".join(f'quote("{c}")' for c in columns)
        for (values,) in conn.execute(f'SELECT {quoted} FROM "{name}" ORDER BY rowid'):
            lines.append(f'INSERT INTO "{name}" VALUES({values});\n')
    return "".join(lines)


def statements(text: str) -> tuple[str | None, list[str]]:
    """(revision named in the header, the statements) of a snapshot's text."""
    first = text.split("\n", 1)[0]
    prefix = _HEADER.split("{rev}")[0]
    revision = first[len(prefix):].split(":", 1)[0] if first.startswith(prefix) else None
    out, pending = [], ""
    for line in text.splitlines(keepends=True):
        if not pending and line.startswith("--"):
            continue
        pending += line
        if sqlite3.complete_statement(pending):
            out.append(pending.strip())
            pending = ""
    return revision, out


def create_if_empty(engine: Engine, revision: str) -> bool:
    """Make the schema from the snapshot if the database has no table yet and the snapshot is of `revision`;
    False (nothing done) otherwise. The emptiness is checked under the write lock (BEGIN IMMEDIATE), so of two
    processes starting on one new file, one makes the schema and the other finds it made."""
    try:
        text = path().read_text(encoding="utf-8")
    except OSError:
        return False
    found, todo = statements(text)
    if found != revision or not todo:
        return False
    with engine.begin() as conn:
        driver = conn.connection.driver_connection
        if driver.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            return False
        for sql in todo:
            driver.execute(sql)
    return True

