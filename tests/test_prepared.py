"""Prepared hot-path writes (vgpumgr.db.prepared) store exactly what SQLAlchemy's own execution stores."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import insert, select, text

from vgpumgr.db import store
from vgpumgr.db.models import Allocation, Host
from vgpumgr.db.prepared import Prepared
from vgpumgr.db.session import get_engine

_ALLOC = Allocation.__table__


def _values(host_id: int, uuid: str, key: str) -> dict[str, Any]:
    at = datetime(2026, 11, 23, 12, 30, 1, 123456, tzinfo=UTC)
    return {"host_id": host_id, "backend": "mdev", "parent": "0000:65:00.0", "type_id": "nvidia-222",
            "uuid": uuid, "pci_address": None, "gpu_id": None, "vm_id": None, "lease_id": None,
            "type_name": "GRID T4-4Q", "series": "Q", "idempotency_key": key,
            "detail": {"gpu": "0000:65:00.0", "nested": [1, "two", None], "é": True}, "state": "reserved",
            "created_at": at, "activated_at": None, "released_at": None, "owner_host": "hv1",
            "owner_boot": "b" * 32, "owner_pid": 4242, "owner_started": 1234.5,
            "lease_until": at + timedelta(seconds=30)}


def test_a_prepared_insert_stores_what_core_stores(db_url: str) -> None:
    engine = get_engine(db_url)
    with engine.begin() as conn:
        host_id = conn.execute(insert(Host.__table__).values(name=f"prep-{id(conn)}").returning(Host.id)).scalar()
        core = conn.execute(insert(_ALLOC).values(**_values(host_id, "00000000-0000-4000-8000-00000000000a", "k1"))
                            .returning(_ALLOC.c.id)).scalar()
        prepared = store._RESERVE[conn.dialect.name].execute(
            conn, _values(host_id, "00000000-0000-4000-8000-00000000000b", "k2")).fetchone()[0]
        rows = {r.id: r for r in conn.execute(select(_ALLOC).where(_ALLOC.c.id.in_([core, prepared])))}
        # the stored text too (SQLite keeps DateTime and JSON as text: formats must match exactly)
        raw = {r[0]: r[1:] for r in conn.execute(
            text("SELECT id, CAST(created_at AS TEXT), CAST(lease_until AS TEXT), CAST(detail AS TEXT) "
                 "FROM allocations WHERE id IN (:a, :b)"), {"a": core, "b": prepared})}
    skip = {"id", "uuid", "idempotency_key"}
    assert {k: v for k, v in rows[prepared]._mapping.items() if k not in skip} == \
        {k: v for k, v in rows[core]._mapping.items() if k not in skip}
    assert rows[prepared].created_at.tzinfo is not None
    assert raw[prepared] == raw[core]


def test_a_prepared_update_reports_its_rowcount_and_keeps_its_literals(db_url: str) -> None:
    engine = get_engine(db_url)
    with engine.begin() as conn:
        host_id = conn.execute(insert(Host.__table__).values(name=f"prep-u-{id(conn)}").returning(Host.id)).scalar()
        aid = store._RESERVE[conn.dialect.name].execute(
            conn, _values(host_id, "00000000-0000-4000-8000-00000000000c", None)).fetchone()[0]
        at = datetime(2026, 11, 23, 13, 0, tzinfo=UTC)
        assert store._ACTIVATE_DONE.execute(conn, {"aid": aid, "at": at}).rowcount == 1
        assert store._ACTIVATE_DONE.execute(conn, {"aid": aid, "at": at}).rowcount == 0  # only from reserved
        row = conn.execute(select(_ALLOC).where(_ALLOC.c.id == aid)).one()
    assert (row.state, row.activated_at, row.owner_pid, row.lease_until) == ("active", at, None, None)


def test_statements_with_expanding_parameters_are_refused(db_url: str) -> None:
    from sqlalchemy import update

    engine = get_engine(db_url)
    p = Prepared(update(_ALLOC).where(_ALLOC.c.id.in_([1, 2])).values(state="released"))
    with engine.connect() as conn, pytest.raises(ValueError, match="expanding"):
        p.execute(conn, {})


def test_pooled_connections_survive_a_server_restart_after_idling(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ping per checkout: an idle pooled connection is checked (and replaced) before use instead."""
    from pg import PgServer, PgUnavailable
    from sqlalchemy import event

    from vgpumgr.db import session as db_session

    try:
        server = PgServer().start()
    except PgUnavailable as exc:
        pytest.skip(f"PostgreSQL is not available: {exc}")
    try:
        engine = db_session.make_engine(server.url())
        pings: list[str] = []
        event.listen(engine, "before_cursor_execute", lambda c, cur, stmt, *a: pings.append(stmt))
        for _ in range(3):  # in steady use: no extra statement per checkout
            with engine.connect() as conn:
                assert conn.execute(text("SELECT 41 + 1")).scalar() == 42
        assert pings == ["SELECT 41 + 1"] * 3
        server.restart()  # the pooled connection is now dead
        monkeypatch.setattr(db_session, "PING_AFTER_IDLE_S", 0.0)  # as if it had sat idle long enough
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
        engine.dispose()
    finally:
        server.stop()


def test_a_failing_prepared_write_raises_what_sqlalchemy_would(db_url: str) -> None:
    """The driver's error comes out as SQLAlchemy's (callers and the pool's disconnect handling see one kind)."""
    from sqlalchemy.exc import IntegrityError

    engine = get_engine(db_url)
    with engine.connect() as conn:
        conn.begin()
        host_id = conn.execute(insert(Host.__table__).values(name=f"prep-e-{id(conn)}").returning(Host.id)).scalar()
        values = _values(host_id, "00000000-0000-4000-8000-00000000000d", None)
        values["host_id"] = host_id + 10_000  # no such host: the foreign key refuses it
        with pytest.raises(IntegrityError):
            store._RESERVE[conn.dialect.name].execute(conn, values)
        conn.rollback()


def test_array_literals_reach_postgresql_as_the_values_they_were(pg_server: Any) -> None:
    """The fleet change's arrays go as literals: any text (quotes, backslashes, braces, commas, the word NULL) and
    NULL come back as they were, through both of the drivers a fleet URL may name."""
    from vgpumgr.db.prepared import pg_ints, pg_texts

    texts = ['a"b', "c\\d", None, "NULL", "", "{x,y}", " spaced ", "0000:41:00.0", "nvidia-222", "é\u2603"]
    ints = [0, None, -3, 2**31 - 1]
    url = pg_server.create_database()  # type: ignore[attr-defined]
    for driver_url in (url, url.replace("postgresql://", "postgresql+psycopg2://")):
        with get_engine(driver_url).connect() as conn:
            got = conn.execute(text("SELECT CAST(:t AS varchar[]), CAST(:i AS int[]), CAST(:e AS int[])"),
                               {"t": pg_texts(texts), "i": pg_ints(ints), "e": pg_ints([])}).one()
        assert (got[0], got[1], got[2]) == (texts, ints, [])
