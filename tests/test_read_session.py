"""Lookups (`read_sessions`) end with COMMIT, so that psycopg 3 keeps its prepared statements; a lookup that
wrongly changed an object ends in a rollback instead, flushed or not, so nothing it did sticks."""

from __future__ import annotations

from pathlib import Path

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
