"""Every earlier schema revision, with data in it, upgraded to head; the last step downgraded and upgraded again.

The fixtures (tests/fixtures/schema/<revision>.sql, written by scripts/make_schema_fixtures.py) are one SQLite
database populated by vgpumgr's own commands (VMs on mdev, vendor-VF and MIG-backed vGPUs, a seat pool, tokens,
a cordon, fleet rows, the audit chain) at this release's head and at every revision before it."""

from __future__ import annotations

import io
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from vgpumgr.audit import chain as audit
from vgpumgr.cli.main import main
from vgpumgr.db import schema
from vgpumgr.db import session as dbs

FIXTURES = Path(__file__).parent / "fixtures/schema"
COUNTED = ("allocations", "vms", "licence_pools", "licence_leases", "audit_events", "api_tokens", "gpus")


def _load(path: Path, db: Path) -> str:
    with closing(sqlite3.connect(db)) as conn:
        conn.executescript(path.read_text())
    return f"sqlite:///{db}"


def _counts(url: str) -> dict[str, int]:
    """Rows per table, for the tables the database has (api_tokens came with 0002)."""
    with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as conn:
        have = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return {t: conn.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in COUNTED if t in have}


def test_a_fixture_for_every_revision() -> None:
    assert sorted(p.stem for p in FIXTURES.glob("*.sql")) == [s.revision for s in schema.steps()], \
        "run scripts/make_schema_fixtures.py after adding a migration"


@pytest.mark.parametrize("revision", [s.revision for s in schema.steps()])
def test_each_revision_with_data_upgrades_to_head(revision: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    url = _load(FIXTURES / f"{revision}.sql", tmp_path / "old.db")
    before = _counts(url)
    assert before["allocations"] >= 4 and before["audit_events"] >= 10  # the fixture has data to lose
    dbs.upgrade(url)
    try:
        assert dbs.current_revision(url) == schema.SCHEMA_REVISION
        after = _counts(url)
        assert {t: after[t] for t in before} == before
        with dbs.session_factory(url)() as s:
            result = audit.verify(s)
        assert result.ok and result.checked == before["audit_events"], result.problems
        # and this release's own commands read it
        out, err = io.StringIO(), io.StringIO()
        monkeypatch.setenv("VGPUMGR_HOSTNAME", "fixture-host")
        assert main(["--db", url, "placements", "--json"], out, err) == 0, err.getvalue()
        assert {'"web1"', '"cad1"', '"ml1"', '"later"'} <= {w.strip(",") for w in out.getvalue().split()}
    finally:
        dbs.dispose_engine(url)


def test_the_last_step_downgrades_and_upgrades_again_with_data(tmp_path: Path) -> None:
    head, previous = schema.steps()[-1], schema.steps()[-2]
    url = _load(FIXTURES / f"{head.revision}.sql", tmp_path / "head.db")
    before = _counts(url)
    try:
        dbs.downgrade(url, previous.revision)
        assert dbs.current_revision(url) == previous.revision and _counts(url) == before
        dbs.upgrade(url)
        assert dbs.current_revision(url) == head.revision and _counts(url) == before
    finally:
        dbs.dispose_engine(url)


def test_a_backup_before_the_upgrade_keeps_the_old_schema(tmp_path: Path) -> None:
    old = schema.steps()[-2].revision
    url = _load(FIXTURES / f"{old}.sql", tmp_path / "old.db")
    out, err = io.StringIO(), io.StringIO()
    try:
        rc = main(["--db", url, "db", "backup", str(tmp_path / "before.db")], out, err)
        assert rc == 0, err.getvalue()
        assert dbs.current_revision(url) == old  # the database itself was not upgraded by the backup
        with closing(sqlite3.connect(tmp_path / "before.db")) as conn:
            assert conn.execute("SELECT version_num FROM alembic_version").fetchone()[0] == old
        missing = f"sqlite:///{tmp_path / 'none.db'}"
        assert main(["--db", missing, "db", "backup", str(tmp_path / "x.db")], io.StringIO(), err) == 3
        assert "there is no database" in err.getvalue() and not (tmp_path / "none.db").exists()
    finally:
        dbs.dispose_engine(url)
