"""Hot-path writes as prepared statements: a Core statement compiled once per dialect and run on the DBAPI
cursor of the caller's connection, inside the caller's transaction.

SQLAlchemy's `Connection.execute` builds an execution context, runs its events and wraps a result for
every call: ~35 us per statement on this machine, against ~4 us for the driver itself (`scripts/bench_floor.py`:
a pair's database work takes 1.65 ms through Core, 1.20 ms as run here, 0.69 ms at the driver). The allocation
path's INSERTs and UPDATEs (nine per allocate+release)
skip that layer; the statement text, the parameter order and the type conversions (naive UTC for SQLite's
DateTime, JSON text) are still SQLAlchemy's, taken from its compiled form. SELECTs keep going through
SQLAlchemy, which converts their result rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.sql.expression import Executable

executed = 0  # statements run here since start (the benchmarks add them to the engine's statement count)


@dataclass(frozen=True)
class _Plan:
    sql: str
    positional: tuple[str, ...] | None  # parameter order (qmark/format drivers); None: named (pyformat)
    processors: dict[str, Callable[[Any], Any]]
    constants: dict[str, Any]  # binds with a value in the statement itself (e.g. a state literal)


class Prepared:
    """One INSERT/UPDATE with a fixed set of parameter names."""

    def __init__(self, stmt: Executable, keys: tuple[str, ...] = ()) -> None:
        self.stmt = stmt
        self.keys = keys  # an INSERT's columns: the compiled statement names exactly these
        self._plans: dict[str, _Plan] = {}
        self._lock = threading.Lock()

    def execute(self, conn: Connection, params: dict[str, Any]) -> Any:
        """Run on `conn`'s driver connection (its transaction); the DBAPI cursor, for rowcount/fetchone."""
        global executed
        plan = self._plans.get(conn.dialect.name) or self._plan(conn)
        values = plan.constants | params
        for name, proc in plan.processors.items():  # as SQLAlchemy does: None too (JSON may write 'null')
            values[name] = proc(values.get(name))
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        args = values if plan.positional is None else [values[k] for k in plan.positional]
        try:
            cursor.execute(plan.sql, args)
        except Exception as exc:
            # as Connection.execute would: SQLAlchemy's exception types, and a lost server connection invalidated
            conn._handle_dbapi_exception(exc, plan.sql, args, cursor, None)
            raise  # not reached: the call above always raises
        executed += 1
        return cursor

    def _plan(self, conn: Connection) -> _Plan:
        with self._lock:
            dialect = conn.dialect
            compiled: Any = self.stmt.compile(dialect=dialect, column_keys=list(self.keys) or None)
            if any(b.expanding or b.callable for b in compiled.binds.values()):
                raise ValueError("a prepared statement cannot have expanding or callable parameters")
            every = compiled.construct_params(_check=False)
            constants = {k: v for k, v in every.items() if not compiled.binds[k].required}
            positional = tuple(compiled.positiontup) if compiled.positional else None
            plan = _Plan(compiled.string, positional, dict(compiled._bind_processors), constants)
            self._plans[dialect.name] = plan
            return plan


# Arrays for a statement run at the driver, as PostgreSQL array literals (the statement casts them): psycopg adapting
# a list element by element took ~0.2 ms of each fleet change's 13 arrays, a string next to none
def pg_ints(values: Iterable[int | None]) -> str:
    return "{" + ",".join("NULL" if v is None else str(int(v)) for v in values) + "}"


def pg_texts(values: Iterable[str | None]) -> str:
    return "{" + ",".join("NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
                          for v in values) + "}"
