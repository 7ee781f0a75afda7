"""The audit chain: appends link up, tampering is found and named, concurrent appends never fork."""

from __future__ import annotations

import csv
import io
import json
import threading
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from vgpumgr.audit import chain as audit
from vgpumgr.db.session import get_engine, session_factory
from vgpumgr.errors import InvalidInput

T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


def _fill(url: str, n: int = 5) -> None:
    with session_factory(url)() as s:
        for i in range(n):
            audit.append(s, actor="alice", action=audit.VGPU_CREATE, outcome="ok", host="h1",
                         gpu="0000:3b:00.0" if i % 2 == 0 else "0000:5e:00.0", vm=f"vm{i % 3}",
                         vgpu=f"uuid-{i}", detail={"i": i, "type": "T4-4Q", "tags": ["a", "b"]},
                         at=T0 + timedelta(minutes=i))
        s.commit()


def _exec(url: str, sql: str, **params: object) -> None:
    with get_engine(url).begin() as conn:
        conn.execute(text(sql), params)


def _verify(url: str) -> audit.VerifyResult:
    with session_factory(url)() as s:
        return audit.verify(s)


def test_events_link_into_a_chain(fresh_db_url: str) -> None:
    _fill(fresh_db_url, 4)
    with session_factory(fresh_db_url)() as s:
        events = audit.query(s)
        assert [e.seq for e in events] == [1, 2, 3, 4]
        assert events[0].prev_hash == "0" * 64
        for prev, ev in zip(events, events[1:], strict=False):
            assert ev.prev_hash == prev.hash
        assert audit.head(s) == (4, events[-1].hash)
        assert events[2].at == T0 + timedelta(minutes=2)  # microseconds and zone survive the round trip
        result = audit.verify(s)
    assert result.ok and result.checked == 4 and result.first_bad_seq is None
    assert "intact" in result.message()


def test_rolled_back_append_leaves_no_trace(fresh_db_url: str) -> None:
    _fill(fresh_db_url, 2)
    with session_factory(fresh_db_url)() as s:
        audit.append(s, actor="bob", action=audit.VM_START, outcome="failed", host="h1", vm="x", error="boom")
        s.rollback()
        assert audit.head(s)[0] == 2
        ev = audit.append(s, actor="bob", action=audit.VM_START, outcome="ok", host="h1", vm="x")
        s.commit()
        assert ev.seq == 3
    assert _verify(fresh_db_url).ok


def test_altered_field_is_named(fresh_db_url: str) -> None:
    _fill(fresh_db_url)
    _exec(fresh_db_url, "UPDATE audit_events SET actor = 'mallory' WHERE seq = 3")
    result = _verify(fresh_db_url)
    assert not result.ok and result.first_bad_seq == 3
    assert "event 3" in result.message() and "altered" in result.message()
    assert [p.seq for p in result.problems] == [3]


def test_altered_detail_is_named(fresh_db_url: str) -> None:
    _fill(fresh_db_url)
    _exec(fresh_db_url, "UPDATE audit_events SET detail = :d WHERE seq = 2", d=json.dumps({"i": 99}))
    assert _verify(fresh_db_url).first_bad_seq == 2


def test_rewritten_event_with_recomputed_hash_is_named(fresh_db_url: str) -> None:
    _fill(fresh_db_url)
    with session_factory(fresh_db_url)() as s:
        ev = audit.query(s, vgpu="uuid-1")[0]
        forged = audit.event_hash(ev.prev_hash, seq=ev.seq, at=ev.at, host=ev.host, actor="mallory",
                                  action=ev.action, outcome=ev.outcome, gpu=ev.gpu, vm=ev.vm, vgpu=ev.vgpu,
                                  error=ev.error, detail=ev.detail)
    _exec(fresh_db_url, "UPDATE audit_events SET actor = 'mallory', hash = :h WHERE seq = 2", h=forged)
    result = _verify(fresh_db_url)
    assert result.first_bad_seq == 2 and "altered" in result.problems[0].reason


def test_deleted_event_is_named(fresh_db_url: str) -> None:
    _fill(fresh_db_url)
    _exec(fresh_db_url, "DELETE FROM audit_events WHERE seq = 2")
    result = _verify(fresh_db_url)
    assert result.first_bad_seq == 2 and "deleted" in result.problems[0].reason
    assert len(result.problems) == 1


def test_deleted_newest_event_is_named(fresh_db_url: str) -> None:
    _fill(fresh_db_url)
    _exec(fresh_db_url, "DELETE FROM audit_events WHERE seq = 5")
    result = _verify(fresh_db_url)
    assert result.first_bad_seq == 5 and "deleted" in result.problems[0].reason


def test_concurrent_appends_do_not_fork_the_chain(fresh_db_url: str) -> None:
    threads_n, per_thread = 4, 25
    factory = session_factory(fresh_db_url)
    errors: list[BaseException] = []
    start = threading.Barrier(threads_n)

    def worker(n: int) -> None:
        try:
            start.wait()
            for i in range(per_thread):
                with factory() as s:
                    audit.append(s, actor=f"t{n}", action=audit.PLACEMENT, outcome="ok", host="h1",
                                 detail={"i": i})
                    s.commit()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with factory() as s:
        events = audit.query(s)
        result = audit.verify(s)
    total = threads_n * per_thread
    assert [e.seq for e in events] == list(range(1, total + 1))
    assert len({e.prev_hash for e in events}) == total  # no two events extend the same head
    assert result.ok and result.checked == total


def test_query_filters_and_exports(fresh_db_url: str) -> None:
    _fill(fresh_db_url, 6)
    with session_factory(fresh_db_url)() as s:
        assert [e.seq for e in audit.query(s, vm="vm0")] == [1, 4]
        assert [e.seq for e in audit.query(s, gpu="0000:5e:00.0")] == [2, 4, 6]
        assert [e.seq for e in audit.query(s, since=T0 + timedelta(minutes=2),
                                           until=T0 + timedelta(minutes=4))] == [3, 4]
        naive = (T0 + timedelta(minutes=5)).replace(tzinfo=None)  # naive means UTC
        assert [e.seq for e in audit.query(s, since=naive)] == [6]
        assert [e.seq for e in audit.query(s, limit=2, newest_first=True)] == [6, 5]
        events = audit.query(s, vm="vm1")

    rows = list(csv.DictReader(io.StringIO(audit.to_csv(events))))
    assert [int(r["seq"]) for r in rows] == [2, 5]
    assert rows[0]["actor"] == "alice" and rows[0]["error"] == ""
    assert json.loads(rows[0]["detail"]) == {"i": 1, "type": "T4-4Q", "tags": ["a", "b"]}
    assert rows[0]["at"] == "2026-03-01T12:01:00.123456+00:00"

    data = json.loads(audit.to_json(events))
    assert [d["seq"] for d in data] == [2, 5] and data[1]["detail"]["i"] == 4
    assert data[0]["hash"] == events[0].hash


def test_append_validates_and_normalizes(fresh_db_url: str) -> None:
    with session_factory(fresh_db_url)() as s:
        with pytest.raises(InvalidInput):
            audit.append(s, actor="a", action="x", outcome="maybe", host="h")
        ev = audit.append(s, actor="a", action="x", outcome="failed", host="h", error=ValueError("bad value"),
                          detail={"when": T0})
        s.commit()
        assert ev.error == "bad value" and ev.detail == {"when": str(T0)}
    assert _verify(fresh_db_url).ok


def test_appends_from_two_processes_interleave(fresh_db_url: str) -> None:
    """Each engine remembers the head it wrote last; when another writer moved it, it must re-read."""
    from vgpumgr.db.session import make_engine

    engines = [make_engine(fresh_db_url), make_engine(fresh_db_url)]
    try:
        for i in range(6):
            with session_factory(engines[i % 2])() as s:
                audit.append(s, actor=f"proc{i % 2}", action=audit.RECONCILE, outcome="ok", host="h1")
                s.commit()
        with session_factory(engines[0])() as s:
            result = audit.verify(s)
            assert [e.actor for e in audit.query(s)] == ["proc0", "proc1"] * 3
    finally:
        for engine in engines:
            engine.dispose()
    assert result.ok and result.checked == 6


def test_appends_in_a_row_cost_one_statement_on_postgresql_and_two_on_sqlite(fresh_db_url: str) -> None:
    """The head this process wrote last is assumed: PostgreSQL moves it and writes the event in one statement
    (a data-modifying CTE), SQLite in two; a head moved by someone else falls back to the locked read."""
    from sqlalchemy import event

    from vgpumgr.db import prepared

    factory = session_factory(fresh_db_url)
    engine = factory.kw["bind"]
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda c, cur, stmt, *a: seen.append(stmt))

    def append(i: int) -> int:
        before_engine, before_prepared = len(seen), prepared.executed
        with factory.begin() as s:
            audit.append(s, actor="t", action=audit.PLACEMENT, outcome="ok", host="h1", detail={"i": i})
        return len(seen) - before_engine + prepared.executed - before_prepared

    append(0)  # the first append of this engine reads the head
    costs = [append(i) for i in range(1, 4)]
    with factory.begin() as s:  # someone else appends: the cached head is stale now
        head_seq, head_hash = audit.head(s)
        values = {"at": audit.utcnow(), "host": "h2", "actor": "other", "action": audit.PLACEMENT,
                  "outcome": "ok", "gpu": None, "vm": None, "vgpu": None, "error": None, "detail": None}
        audit._link(values, head_seq, head_hash)
        s.execute(audit._UPDATE_HEAD, {"seq": values["seq"], "hash": values["hash"]})
        s.execute(audit._INSERT_EVENT, values)
    stale = append(5)
    assert costs == ([1, 1, 1] if engine.dialect.name == "postgresql" else [2, 2, 2])
    assert stale > costs[0]  # the conditional write missed, then the locked read, update and insert
    with factory() as s:
        result = audit.verify(s)
        assert result.ok and [e.seq for e in audit.query(s)][-2:] == [5, 6]
