"""A PostgreSQL database created with encoding SQL_ASCII (what initdb makes under LANG=C or POSIX) works (issue 38):
psycopg would hand back bytes for text there and SQLAlchemy's first connect failed (exit 70); vgpumgr asks for
UTF8 on the client side, and `doctor` names the encoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from simhost import run

from vgpumgr.sim import profiles


@pytest.mark.postgres
def test_a_sql_ascii_database_is_upgraded_used_and_named_by_doctor(pg_server: object, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy import create_engine

    engine = create_engine(pg_server.url(), isolation_level="AUTOCOMMIT")  # type: ignore[attr-defined]
    with engine.connect() as conn:
        conn.exec_driver_sql("CREATE DATABASE vgpumgr_ascii ENCODING 'SQL_ASCII' TEMPLATE template0")
    engine.dispose()
    url = pg_server.url("vgpumgr_ascii")  # type: ignore[attr-defined]
    root = profiles.create(tmp_path / "host", "t4")
    monkeypatch.setenv("VGPUMGR_SYSFS_ROOT", str(root))
    monkeypatch.setenv("VGPUMGR_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VGPUMGR_DB", url)
    monkeypatch.setenv("VGPUMGR_ACTOR", "cli:zoë")  # a name beyond ASCII goes in and comes back whole
    rc, out, err = run("db", "upgrade")
    assert rc == 0 and "database at revision" in out, err
    assert run("vgpu", "--type", "T4-4Q", "--vm", "web1")[0] == 0
    events = json.loads(run("audit", "list", "--json")[1])
    assert any(e["actor"] == "cli:zoë" for e in events), events
    report = json.loads(run("doctor", "--json")[1])
    enc = next(r for r in report["results"] if r["key"] == "db.encoding")
    assert enc["level"] == "WARN" and "SQL_ASCII" in enc["message"] and "createdb -E UTF8" in enc["hint"]
