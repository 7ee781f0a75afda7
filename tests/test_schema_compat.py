"""Which schemas a vgpumgr works with (vgpumgr.db.schema), what `db upgrade` may do, and the commands around it:
a database newer or older than the code, a missing driver or server, backups that restore, `upgrade check`."""

from __future__ import annotations

import ast
import io
import json
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from vgpumgr.cli.main import main
from vgpumgr.db import schema
from vgpumgr.db import session as dbs
from vgpumgr.db.schema import HostVersion, State, Step
from vgpumgr.errors import SchemaMismatch
from vgpumgr.sim import profiles

VERSIONS = Path(schema.MIGRATIONS_DIR) / "versions"
NOW = datetime(2026, 11, 26, tzinfo=UTC)


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(list(argv), out, err)
    assert rc != 70, err.getvalue()
    return rc, out.getvalue(), err.getvalue()


# -- the rules, pure -------------------------------------------------------------------------------------------
STEPS = (Step("0009_a", 9, "expand", None, ""), Step("0010_b", 10, "expand", None, ""),
         Step("0011_c", 11, "contract", 10, ""), Step("0012_d", 12, "expand", None, ""))


@pytest.fixture
def chain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schema, "steps", lambda: STEPS)
    monkeypatch.setattr(schema, "SCHEMA_REVISION", "0011_c")


def host(name: str, known: int | None, seen_h: float = 1) -> HostVersion:
    return HostVersion(name, "x", known, NOW - timedelta(hours=seen_h), seen_h <= 24)


def test_plan_applies_expand_steps_and_holds_contract_ones(chain: None) -> None:
    p = schema.plan(State("0009_a"), [host("old", 9)], contract=False)
    assert [s.revision for s in p.apply] == ["0010_b"] and [s.revision for s in p.held] == ["0011_c", "0012_d"]
    assert p.target == "0010_b" and [h.name for h in p.blockers["0011_c"]] == ["old"]  # said, even unasked
    p = schema.plan(State("0010_b"), [host("old", 9), host("new", 11), host("gone", 9, seen_h=48)], contract=True)
    assert p.apply == [] and [h.name for h in p.blockers["0011_c"]] == ["old"]  # a host long gone does not count
    p = schema.plan(State("0010_b"), [host("old", 9), host("new", 11)], contract=True, ignore=frozenset({"old"}))
    assert [s.revision for s in p.apply] == ["0011_c", "0012_d"] and p.target == "0012_d"
    assert schema.plan(State("0012_d"), [], contract=False).ahead


def test_check_what_code_may_use(chain: None) -> None:
    assert schema.check(State("0011_c", 10), dialect="postgresql") == "ok"
    assert schema.check(State("0010_b"), dialect="postgresql") == "ok"  # only the contract step is pending
    assert schema.check(State("0012_d", 10), dialect="postgresql") == "ok"  # newer, not contracted past us
    assert schema.check(State("0009_a"), dialect="sqlite") == "upgrade"
    with pytest.raises(SchemaMismatch, match=r"1 step\(s\) pending: 0010_b") as behind:
        schema.check(State("0009_a"), dialect="postgresql")
    assert "vgpumgr db upgrade" in str(behind.value.hint) and behind.value.exit_code == 11
    with pytest.raises(SchemaMismatch, match="has been contracted"):
        schema.check(State("0013_e", 12), dialect="sqlite")
    with pytest.raises(SchemaMismatch, match="cannot place"):
        schema.check(State("abc"), dialect="sqlite")


def test_every_migration_declares_its_phase_and_expand_steps_remove_nothing() -> None:
    removals = ("drop_table", "drop_column", "drop_constraint", "drop_index", "alter_column", "rename_table")
    for step in schema.steps():
        assert step.phase in ("expand", "contract") and step.ordinal == schema.ordinal(step.revision)
        tree = ast.parse(next(VERSIONS.glob(f"{step.revision}*.py")).read_text())
        upgrade = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "upgrade")
        called = {n.func.attr for n in ast.walk(upgrade) if isinstance(n, ast.Call) and
                  isinstance(n.func, ast.Attribute)}
        if step.phase == "expand":
            assert not called & set(removals), f"{step.revision} is an expand step but calls {called & set(removals)}"
        else:
            assert step.min_code, f"{step.revision}: a contract step names contract_min_code"
    assert schema.steps()[-1].revision == schema.SCHEMA_REVISION


# -- a database newer or older than this code -------------------------------------------------------------------
@pytest.fixture
def simhost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = profiles.create(tmp_path / "host", "l40s-vfio")
    monkeypatch.setenv("VGPUMGR_SYSFS_ROOT", str(root))
    monkeypatch.setenv("VGPUMGR_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VGPUMGR_LIBVIRT_URI", "test:///default")
    monkeypatch.setenv("VGPUMGR_HOSTNAME", "h1")
    return root


def _stamp(url: str, revision: str, level: int) -> None:
    with dbs.get_engine(url).begin() as conn:
        conn.exec_driver_sql(f"UPDATE alembic_version SET version_num = '{revision}'")
        conn.exec_driver_sql(f"UPDATE vgpumgr_schema SET contract_level = {level}")
    dbs.forget_schema(url)


def test_a_newer_schema_serves_old_code_until_contracted(simhost: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state/vgpumgr.db'}"
    assert run("vm", "create", "web1", "--vgpu", "L40S-2Q")[0] == 0
    _stamp(url, "0099_future", schema.code_ordinal())  # a newer release expanded it
    assert run("vm", "create", "web2", "--vgpu", "L40S-2Q")[0] == 0
    rc, out, _ = run("db", "upgrade")
    assert rc == 0 and "newer than this vgpumgr" in out
    assert json.loads(run("db", "current", "--json")[1])["compatible"] is True
    _stamp(url, "0099_future", 99)  # ... and then contracted it
    rc, _, err = run("placements")
    assert rc == 11 and "0099_future" in err and "has been contracted" in err and "upgrade vgpumgr" in err, err
    assert run("db", "upgrade")[0] == 11
    cur = json.loads(run("db", "current", "--json")[1])
    assert cur["compatible"] is False and "contracted" in cur["reason"]
    rc, out, _ = run("upgrade", "check")
    assert rc == 10 and "BLOCK  schema" in out
    dbs.dispose_engine(url)


@pytest.mark.postgres
def test_postgresql_is_upgraded_only_on_purpose(simhost: Path, pg_server: object, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    url = pg_server.create_database("behind")  # type: ignore[attr-defined]
    monkeypatch.setenv("VGPUMGR_DB", url)
    dbs.upgrade(url, "0008_fleet_rows")  # as the release before this one left it
    rc, _, err = run("placements")
    assert rc == 11 and schema.SCHEMA_REVISION in err and "vgpumgr db upgrade" in err, err
    rc, out, _ = run("db", "upgrade", "--dry-run")
    assert rc == 0 and "would apply 0009_rolling_upgrades (expand)" in out
    assert dbs.stored_revision(url) == "0008_fleet_rows"
    # two hosts upgrading at once: the advisory lock lets one do it, the other finds it done
    argv = [sys.executable, "-m", "vgpumgr.cli.main", "--db", url, "db", "upgrade"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum("applied 0009_rolling_upgrades" in o for o, _ in outs) == 1, outs
    dbs.forget_schema(url)
    assert run("vm", "create", "web1", "--vgpu", "L40S-2Q")[0] == 0
    rows = json.loads(run("upgrade", "check", "--json")[1])
    assert rows["ok"] and rows["vms"] == ["web1"] and rows["schema"]["database"] == schema.SCHEMA_REVISION
    dbs.dispose_engine(url)


def test_a_missing_driver_or_server_is_exit_8(simhost: Path, tmp_path: Path) -> None:
    rc, _, err = run("--db", "postgresql+pg8000://u@localhost/x", "placements")
    assert rc == 8 and "driver" in err and "pg8000" in err, err
    rc, _, err = run("--db", f"postgresql://nobody@/x?host={tmp_path}/no-server", "placements")
    assert rc == 8 and "cannot use the database" in err and "hint:" in err, err


def test_postgresql_url_means_psycopg_3() -> None:
    assert dbs.driver_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert dbs.driver_url("postgresql+psycopg2://u@h/db").drivername == "postgresql+psycopg2"


# -- backups -----------------------------------------------------------------------------------------------------
def test_commands_leave_their_data_in_the_database_file(simhost: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {"VGPUMGR_SYSFS_ROOT": str(simhost), "VGPUMGR_STATE_DIR": str(state), "VGPUMGR_HOSTNAME": "h1",
           "VGPUMGR_LIBVIRT_URI": "test:///default", "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-m", "vgpumgr.cli.main", "vgpu", "--type", "L40S-2Q", "--vm", "v"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    copy = tmp_path / "copy.db"  # what `cp vgpumgr.db` takes: the file alone, without its -wal
    copy.write_bytes((state / "vgpumgr.db").read_bytes())
    with closing(sqlite3.connect(copy)) as conn:
        assert conn.execute("SELECT count(*) FROM allocations").fetchone()[0] == 1  # checkpointed at exit


def test_backup_and_restore(simhost: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state/vgpumgr.db'}"
    assert run("vm", "create", "web1", "--vgpu", "L40S-2Q")[0] == 0
    backup = tmp_path / "b.db"
    rc, out, _ = run("db", "backup", str(backup))
    assert rc == 0 and "chain verified" in out and backup.stat().st_mode & 0o777 == 0o600
    assert run("db", "backup", str(backup))[0] == 4  # exists
    assert run("vm", "create", "web2", "--vgpu", "L40S-2Q")[0] == 0
    tampered = tmp_path / "t.db"
    tampered.write_bytes(backup.read_bytes())
    with closing(sqlite3.connect(tampered)) as conn:
        conn.execute("UPDATE audit_events SET actor = 'someone-else' WHERE seq = 1")
        conn.commit()
    rc, _, err = run("db", "restore", str(tampered))
    assert rc == 9 and "does not verify" in err
    rc, out, _ = run("db", "restore", str(backup))
    assert rc == 0 and "before-restore" in out
    names = {r["vm"] for r in json.loads(run("placements", "--json")[1])}
    assert names == {"web1"}  # web2 came after the backup
    assert run("audit", "verify")[0] == 0
    assert run("db", "restore", str(tmp_path / "missing.db"))[0] == 3
    dbs.dispose_engine(url)


@pytest.mark.postgres
def test_backup_of_postgresql_points_at_pg_dump(simhost: Path, pg_server: object) -> None:
    url = pg_server.create_database("bk")  # type: ignore[attr-defined]
    rc, _, err = run("--db", url, "db", "backup", "/tmp/x.db")
    assert rc == 2 and "pg_dump" in err


# -- upgrade check -----------------------------------------------------------------------------------------------
def test_upgrade_check_names_a_kernel_without_vendor_vfs(simhost: Path) -> None:
    assert run("vm", "create", "web1", "--vgpu", "L40S-2Q")[0] == 0
    (simhost / "proc/sys/kernel").mkdir(parents=True, exist_ok=True)
    (simhost / "proc/sys/kernel/osrelease").write_text("6.12.9-amd64\n")
    rc, out, _ = run("upgrade", "check")
    assert rc == 0 and "WARN   vms     1 VM(s) with vGPUs recorded here: web1" in out, out
    (simhost / "boot").mkdir()
    for k in ("6.12.9-amd64", "6.1.0-28-amd64"):
        (simhost / f"boot/vmlinuz-{k}").touch()
    assert run("upgrade", "check")[0] == 0  # the newest installed kernel is the running one
    rc, out, _ = run("upgrade", "check", "--kernel", "6.1.0-28-amd64", "--driver", "570.124.03")
    assert rc == 10 and "6.8 or newer needed" in out and "upgrade blocked" in out, out
    report = json.loads(run("upgrade", "check", "--kernel", "6.1.0-28-amd64", "--json")[1])
    assert not report["ok"] and report["kernel"] == {"running": "6.12.9-amd64", "next": "6.1.0-28-amd64"}


def test_upgrade_check_reads_beside_a_writer_without_waiting(simhost: Path, tmp_path: Path) -> None:
    assert run("vm", "create", "web1", "--vgpu", "L40S-2Q")[0] == 0
    writer = sqlite3.connect(tmp_path / "state/vgpumgr.db", timeout=0)
    try:
        writer.execute("BEGIN IMMEDIATE")  # the running service in the middle of a write
        started = time.monotonic()
        rc, out, err = run("upgrade", "check")
        assert rc == 0 and "web1" in out, err
        assert time.monotonic() - started < 10  # a write lock would wait out the 30 s busy timeout
    finally:
        writer.rollback()
        writer.close()
