"""Schema migrations, engine settings and the store's allocation rules, on SQLite and PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from vgpumgr.db import session as dbs
from vgpumgr.db import store
from vgpumgr.db.models import Allocation, Base
from vgpumgr.errors import Conflict, InvalidInput

VGPUMGR_TABLES = {"hosts", "gpus", "vgpu_types", "vms", "allocations", "licence_pools", "licence_leases",
                  "audit_events", "audit_head"}


def _tables(url: str) -> set[str]:
    with dbs.get_engine(url).connect() as conn:
        return set(inspect(conn).get_table_names())


def test_upgrade_downgrade_upgrade(empty_db_url: str) -> None:
    assert dbs.current_revision(empty_db_url) is None
    dbs.upgrade(empty_db_url)
    assert dbs.current_revision(empty_db_url) == dbs.head_revision()
    assert VGPUMGR_TABLES <= _tables(empty_db_url)
    with dbs.get_engine(empty_db_url).connect() as conn:
        # The migrations build exactly what the models describe (columns, types, indexes). Tables other
        # modules keep in their own metadata (api_tokens) are theirs to check.
        opts = {"compare_type": True,
                "include_name": lambda name, kind, _parent: kind != "table" or name in Base.metadata.tables}
        assert compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata) == []
        assert conn.execute(text("SELECT seq, hash FROM audit_head")).all() == [(0, "0" * 64)]

    dbs.downgrade(empty_db_url, "base")
    assert dbs.current_revision(empty_db_url) is None
    assert not (VGPUMGR_TABLES & _tables(empty_db_url))

    dbs.upgrade(empty_db_url)
    dbs.upgrade(empty_db_url)  # running it again on every start is harmless
    assert dbs.current_revision(empty_db_url) == dbs.head_revision()
    assert VGPUMGR_TABLES <= _tables(empty_db_url)


def test_sqlite_connection_settings(tmp_path) -> None:
    url = f"sqlite:///{tmp_path}/sub/dir/v.db"  # missing parent dirs are created
    engine = dbs.make_engine(url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == dbs.SQLITE_BUSY_TIMEOUT_MS
    engine.dispose()


def test_default_db_url(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("VGPUMGR_DB", "postgresql://u@db/vgpu")
    assert dbs.default_db_url() == "postgresql://u@db/vgpu"
    monkeypatch.delenv("VGPUMGR_DB")
    monkeypatch.delenv("VGPUMGR_STATE_DIR", raising=False)
    monkeypatch.setattr("os.geteuid", lambda: 0)
    assert dbs.default_db_url() == "sqlite:////var/lib/vgpumgr/vgpumgr.db"
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert dbs.default_db_url() == f"sqlite:///{tmp_path}/vgpumgr/vgpumgr.db"


def test_unsupported_url_is_refused() -> None:
    with pytest.raises(InvalidInput):
        dbs.make_engine("mysql://x@y/z")
    with pytest.raises(InvalidInput):
        dbs.make_engine("not a url")


@pytest.fixture
def host(db_session):
    h = store.upsert_host(db_session, f"host-{uuid.uuid4().hex[:8]}")
    db_session.commit()
    return h


def _mdev(session, host, **kw) -> Allocation:
    args = {"backend": "mdev", "parent": "0000:3b:00.0", "type_id": "nvidia-232", "uuid": str(uuid.uuid4())}
    args.update(kw)
    return store.reserve_allocation(session, host, **args)


def test_upserts_are_idempotent(db_session, host) -> None:
    g1 = store.upsert_gpu(db_session, host, "3b:00.0", model="Tesla T4", uuid="GPU-1")
    g2 = store.upsert_gpu(db_session, host.id, "0000:3B:00.0", model="Tesla T4", serial="123")
    assert g1.id == g2.id and g2.address == "0000:3b:00.0"
    assert (g2.uuid, g2.serial) == ("GPU-1", "123")  # earlier facts kept, new ones added
    v1 = store.upsert_vm(db_session, host, "web1")
    v2 = store.upsert_vm(db_session, host, "web1", state="running")
    assert v1.id == v2.id and v2.state == "running"
    t1 = store.upsert_vgpu_type(db_session, host, gpu_model="Tesla T4", type_id="nvidia-232",
                                name="GRID T4-4Q", backend="mdev", series="Q", framebuffer_mb=4096)
    t2 = store.upsert_vgpu_type(db_session, host, gpu_model="Tesla T4", type_id="nvidia-232",
                                name="NVIDIA T4-4Q", backend="mdev", series="Q", framebuffer_mb=4096)
    assert t1.id == t2.id and t2.name == "NVIDIA T4-4Q"
    db_session.commit()
    assert [g.address for g in store.gpus(db_session, host)] == ["0000:3b:00.0"]
    assert [v.name for v in store.vms(db_session, host)] == ["web1"]
    assert len(store.vgpu_types(db_session, host, "Tesla T4")) == 1
    with pytest.raises(InvalidInput):
        store.upsert_vm(db_session, host, "bad name/../x")


def test_allocation_lifecycle_and_timestamps(db_session, host) -> None:
    gpu = store.upsert_gpu(db_session, host, "0000:3b:00.0", model="Tesla T4")
    vm = store.upsert_vm(db_session, host, "web1")
    a = _mdev(db_session, host, gpu=gpu, vm=vm, type_name="GRID T4-4Q", series="Q")
    db_session.commit()
    assert a.state == "reserved" and a.activated_at is None
    store.activate(db_session, a)
    db_session.commit()
    db_session.expire_all()
    got = store.live_allocation(db_session, host, uuid=a.uuid)
    assert got is not None and got.state == "active"
    assert got.created_at.tzinfo is not None and got.activated_at.utcoffset() == timedelta(0)
    assert abs(datetime.now(UTC) - got.activated_at) < timedelta(minutes=1)
    store.release(db_session, got)
    store.release(db_session, got)  # idempotent
    db_session.commit()
    assert store.live_allocation(db_session, host, uuid=a.uuid) is None
    assert got.state == "released" and got.released_at >= got.activated_at
    with pytest.raises(Conflict):
        store.activate(db_session, got)


def test_double_allocation_of_an_mdev_uuid_is_impossible(db_session, host) -> None:
    a = _mdev(db_session, host)
    db_session.commit()
    with pytest.raises(Conflict, match="already allocated"):
        _mdev(db_session, host, uuid=a.uuid, parent="0000:3c:00.0")
    # The failed insert did not spoil the transaction; a released one frees the UUID again.
    store.release(db_session, a)
    b = _mdev(db_session, host, uuid=a.uuid)
    db_session.commit()
    assert b.id != a.id
    # The same mdev UUID on another host is another device.
    other = store.upsert_host(db_session, f"other-{uuid.uuid4().hex[:8]}")
    _mdev(db_session, other, uuid=a.uuid)
    db_session.commit()


def test_double_allocation_of_a_pci_function_is_impossible(db_session, host) -> None:
    store.reserve_allocation(db_session, host, backend="nvidia-vf", parent="0000:41:00.0", type_id="nvidia-558",
                             pci_address="0000:41:00.4")
    db_session.commit()
    with pytest.raises(Conflict, match="0000:41:00.4"):
        store.reserve_allocation(db_session, host, backend="passthrough", parent="0000:41:00.4",
                                 type_id="passthrough", pci_address="41:00.4")
    with pytest.raises(InvalidInput):
        store.reserve_allocation(db_session, host, backend="nvidia-vf", parent="0000:41:00.0",
                                 type_id="nvidia-558")


def test_the_database_itself_refuses_a_second_live_row(db_session, host) -> None:
    a = _mdev(db_session, host)
    db_session.commit()
    # Bypass the store: the partial unique index, not Python, is what guards the device.
    dup = Allocation(host_id=host.id, backend="mdev", parent="0000:3b:00.0", type_id="nvidia-232", uuid=a.uuid,
                     state="active", created_at=datetime.now(UTC))
    db_session.add(dup)
    with pytest.raises(IntegrityError):
        db_session.flush()
    db_session.rollback()


def test_idempotency_key_is_unique_per_host(db_session, host) -> None:
    key = f"req-{uuid.uuid4()}"
    a = _mdev(db_session, host, idempotency_key=key)
    db_session.commit()
    assert store.find_by_idempotency_key(db_session, host, key).id == a.id
    assert store.find_by_idempotency_key(db_session, host, "never-used") is None
    with pytest.raises(Conflict, match="idempotency key"):
        _mdev(db_session, host, idempotency_key=key)
    store.release(db_session, a)
    with pytest.raises(Conflict):  # even after release: a key names one request forever
        _mdev(db_session, host, idempotency_key=key)
    other = store.upsert_host(db_session, f"other-{uuid.uuid4().hex[:8]}")
    _mdev(db_session, other, idempotency_key=key)
    db_session.commit()


def test_allocation_filters(db_session, host) -> None:
    g1 = store.upsert_gpu(db_session, host, "0000:3b:00.0")
    g2 = store.upsert_gpu(db_session, host, "0000:5e:00.0")
    web, db = store.upsert_vm(db_session, host, "web"), store.upsert_vm(db_session, host, "db")
    a1 = _mdev(db_session, host, gpu=g1, vm=web)
    a2 = _mdev(db_session, host, gpu=g2, vm=web, parent="0000:5e:00.0")
    a3 = _mdev(db_session, host, gpu=g2, vm=db, parent="0000:5e:00.0")
    store.activate(db_session, a2)
    store.release(db_session, a3)
    db_session.commit()

    def ids(**kw) -> list[int]:
        return [a.id for a in store.allocations(db_session, host, **kw)]

    assert ids() == [a1.id, a2.id, a3.id]
    assert ids(vm="web") == [a1.id, a2.id] and ids(vm=db) == [a3.id]
    assert ids(gpu="5e:00.0") == [a2.id, a3.id] and ids(gpu=g1) == [a1.id]
    assert ids(state="active") == [a2.id] and ids(state=["reserved", "released"]) == [a1.id, a3.id]
    assert ids(live=True) == [a1.id, a2.id] and ids(live=False) == [a3.id]
    assert ids(parent="0000:5e:00.0", vm="web") == [a2.id]
    with pytest.raises(InvalidInput):
        ids(state="gone")


def _sqlite_file(url: str) -> str:
    return url.removeprefix("sqlite:///")


def test_the_sqlite_snapshot_is_what_the_migrations_build(tmp_path) -> None:
    """migrations/sqlite-head.sql equals a dump of a database Alembic brought to head, statement by statement."""
    import sqlite3

    from vgpumgr.db import snapshot

    url = f"sqlite:///{tmp_path}/alembic.db"
    dbs.upgrade(url)
    dbs.dispose_engine(url)
    conn = sqlite3.connect(_sqlite_file(url))
    try:
        dumped = snapshot.dump(conn, dbs.head_revision())
    finally:
        conn.close()
    assert snapshot.path().read_text() == dumped, (
        "migrations/sqlite-head.sql is out of date: run `.venv/bin/python scripts/schema_snapshot.py`")
    assert snapshot.statements(dumped)[0] == dbs.SCHEMA_REVISION


def test_a_new_sqlite_database_gets_its_schema_from_the_snapshot(tmp_path, monkeypatch) -> None:
    import sqlite3

    made = f"sqlite:///{tmp_path}/made.db"
    with monkeypatch.context() as m:
        m.setattr(dbs, "upgrade", lambda *_: pytest.fail("a new SQLite database went through Alembic"))
        dbs.ensure_schema(made)
    assert dbs.current_revision(made) == dbs.head_revision()
    with dbs.get_engine(made).connect() as conn:
        opts = {"compare_type": True,
                "include_name": lambda name, kind, _parent: kind != "table" or name in Base.metadata.tables}
        assert compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata) == []
        assert conn.execute(text("SELECT seq, hash FROM audit_head")).all() == [(0, "0" * 64)]
    reference = f"sqlite:///{tmp_path}/alembic.db"
    dbs.upgrade(reference)
    for url in (made, reference):
        dbs.dispose_engine(url)
    schema = "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name"
    a, b = (sqlite3.connect(_sqlite_file(u)) for u in (made, reference))
    try:
        assert a.execute(schema).fetchall() == b.execute(schema).fetchall()
        for (table,) in b.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
            assert a.execute(f'SELECT * FROM "{table}"').fetchall() == b.execute(f'SELECT * FROM "{table}"').fetchall()
    finally:
        a.close()
        b.close()


def test_the_snapshot_is_used_only_on_an_empty_database_of_its_revision(tmp_path, monkeypatch) -> None:
    from vgpumgr.db import snapshot

    other = tmp_path / "other.sql"  # a snapshot of another revision (a new migration, not yet written out)
    other.write_text(snapshot.path().read_text().replace(dbs.SCHEMA_REVISION, "0000_other", 1))
    url = f"sqlite:///{tmp_path}/v.db"
    engine = dbs.get_engine(url)
    monkeypatch.setattr(snapshot, "path", lambda: other)
    assert snapshot.create_if_empty(engine, dbs.SCHEMA_REVISION) is False
    dbs.ensure_schema(url)  # through Alembic
    assert dbs.current_revision(url) == dbs.SCHEMA_REVISION
    monkeypatch.undo()
    assert snapshot.create_if_empty(engine, dbs.SCHEMA_REVISION) is False  # tables exist: left alone
    dbs.dispose_engine(url)
