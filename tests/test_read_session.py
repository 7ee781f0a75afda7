"""Lookups (`read_sessions`) end with COMMIT, so that psycopg 3 keeps its prepared statements; a lookup that
wrongly changed an object ends in a rollback instead, flushed or not, so nothing it did sticks."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from vgpumgr.db.models import Host
from vgpumgr.db.session import ensure_schema, read_sessions, session_factory


def _db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'v.db'}"
    ensure_schema(url)
    with session_factory(url)() as s:
        s.add(Host(name="h1"))
        s.commit()
    return url


def test_a_lookup_that_changed_an_object_leaves_nothing_behind(tmp_path: Path) -> None:
    url = _db(tmp_path)
    reads = read_sessions(url)
    with reads() as s:
        s.query(Host).filter_by(name="h1").one().name = "flushed"
        s.flush()
    with reads() as s:
        s.query(Host).filter_by(name="h1").one().name = "pending"
    with reads() as s:
        s.add(Host(name="h2"))
    with session_factory(url)() as s:
        assert [h.name for h in s.query(Host)] == ["h1"]


def test_a_lookup_ends_its_transaction(tmp_path: Path) -> None:
    url = _db(tmp_path)
    with read_sessions(url)() as s:
        assert s.query(Host).count() == 1
        assert s.in_transaction()
    assert not s.in_transaction()


def test_the_token_check_and_the_schema_check_keep_statements_prepared(fresh_db_url: str) -> None:
    """Outside a Session too: the REST service's token check (`api.tokens.lookup`) and the schema check each
    heartbeat makes (`stored_state`) end with COMMIT, so the pooled connection keeps what psycopg 3 prepared
    (a ROLLBACK makes it forget all of it, and the next `fleet place` planned its statements again)."""
    if not fresh_db_url.startswith("postgresql"):
        pytest.skip("statements are prepared on PostgreSQL")
    from api import tokens
    from vgpumgr.db.session import get_engine, stored_state

    engine = get_engine(fresh_db_url)  # used one request at a time: one pooled connection

    def prepared() -> int:
        with read_sessions(engine)() as s:
            return int(s.execute(text("SELECT count(*) FROM pg_prepared_statements "
                                      "WHERE statement LIKE 'SELECT count(*) FROM hosts%'")).scalar() or 0)

    for _ in range(6):  # psycopg prepares a statement at its fifth run on a connection
        with read_sessions(engine)() as s:
            s.execute(text("SELECT count(*) FROM hosts")).scalar()
    assert prepared() == 1
    assert tokens.lookup(engine, "not-a-token") is None  # unknown: asks the database
    assert stored_state(fresh_db_url) is not None
    assert prepared() == 1
