"""Issue 43's cases, one by one: `db downgrade` cannot lose data by a typo, files a user names are read and written
by one rule (vgpumgr.userinput.files), numbers by another (vgpumgr.userinput.numbers), the licence token is
checked, and the REST answers a client can act on. tests/test_hostile.py throws generated input at every command
and route; this file pins the behaviour the issue spells out."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sqlite3
import stat
from contextlib import closing
from pathlib import Path

import pytest

from vgpumgr.cli.main import main
from vgpumgr.db import session as dbs
from vgpumgr.db.schema import SCHEMA_REVISION
from vgpumgr.sim import profiles


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = main(list(argv), out, err)
    except SystemExit as e:  # argparse's usage error
        rc = int(e.code or 0)
    assert rc != 70, err.getvalue()
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def simhost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = profiles.create(tmp_path / "host", "l40s-vfio")
    monkeypatch.setenv("VGPUMGR_SYSFS_ROOT", str(root))
    monkeypatch.setenv("VGPUMGR_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VGPUMGR_LIBVIRT_URI", "test:///default")
    monkeypatch.setenv("VGPUMGR_HOSTNAME", "h1")
    yield root
    dbs.dispose_engine(f"sqlite:///{tmp_path / 'state/vgpumgr.db'}")


def _tables(db: Path) -> dict[str, int]:
    with closing(sqlite3.connect(db)) as conn:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {n: conn.execute(f'SELECT count(*) FROM "{n}"').fetchone()[0] for n in names}


# -- db downgrade ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("typo", ["zzzz@base", "nosuch", "", "-999", "head+1", "0099_future", "base:head", "head",
                                  "0012", "-1", "base\n"])
def test_an_unknown_revision_is_refused_before_anything_changes(simhost: Path, tmp_path: Path, typo: str) -> None:
    assert run("vm", "create", "web1", "--vgpu", "L40S-2Q")[0] == 0
    db = tmp_path / "state/vgpumgr.db"
    before = _tables(db)
    rc, _, err = run("db", "downgrade", "--yes-destroy-data", "--", typo)
    assert rc == 2 and "is not a schema revision of this vgpumgr" in err and "0011_scheduler" in err
    assert _tables(db) == before
    assert sorted(p.name for p in db.parent.iterdir() if "before-downgrade" in p.name) == []


def test_downgrade_needs_the_confirmation_takes_a_backup_and_keeps_the_audit_trail(simhost: Path,
                                                                                    tmp_path: Path) -> None:
    assert run("vm", "create", "web1", "--vgpu", "L40S-2Q")[0] == 0
    db = tmp_path / "state/vgpumgr.db"
    before = _tables(db)
    rc, out, err = run("db", "downgrade", "base")
    assert rc == 2 and "--yes-destroy-data" in err and "audit_events" in out and _tables(db) == before
    rc, out, _ = run("db", "downgrade", "base", "--dry-run", "--json")
    assert rc == 0 and json.loads(out)["dropped_tables"]["audit_events"] == before["audit_events"]
    assert _tables(db) == before
    assert run("db", "downgrade", SCHEMA_REVISION)[1].startswith("the database is already at")

    rc, out, _ = run("db", "downgrade", "0011_scheduler", "--yes-destroy-data")
    assert rc == 0 and "licence_deliveries" in out
    assert "licence_deliveries" not in _tables(db)
    assert _tables(db)["audit_events"] == before["audit_events"] + 1  # the downgrade audited itself
    rc, out, _ = run("db", "downgrade", "base", "--yes-destroy-data", "--backup", str(tmp_path / "kept.db"))
    assert rc == 0 and f"audit trail ({before['audit_events'] + 2} events) was dropped" in out
    assert str(tmp_path / "kept.db") in out
    kept = _tables(tmp_path / "kept.db")
    assert kept["audit_events"] == before["audit_events"] + 2 and kept["allocations"] == 1
    assert (tmp_path / "kept.db").stat().st_mode & 0o777 == 0o600
    assert "audit_events" not in _tables(db)
    first = sorted(p.name for p in db.parent.iterdir() if "before-downgrade" in p.name)
    assert len(first) == 1 and first[0].startswith(f"vgpumgr.db.before-downgrade-{SCHEMA_REVISION}-")
    rc, _, err = run("db", "downgrade", "0011_scheduler", "--yes-destroy-data")
    assert rc == 2 and "no schema" in err


def test_a_newer_revision_is_not_a_downgrade(simhost: Path, tmp_path: Path) -> None:
    assert run("vm", "create", "web1", "--vgpu", "L40S-2Q")[0] == 0
    assert run("db", "downgrade", "0012_licence_delivery", "--yes-destroy-data")[0] == 0
    rc, _, err = run("db", "downgrade", "0013_vendor_slices", "--yes-destroy-data")
    assert rc == 2 and "db upgrade" in err


# -- db backup: nothing left beside the copy ----------------------------------------------------------------------
def test_backup_leaves_only_the_file_asked_for(simhost: Path, tmp_path: Path) -> None:
    assert run("vm", "create", "web1", "--vgpu", "L40S-2Q")[0] == 0
    out_dir = tmp_path / "backups"
    out_dir.mkdir()
    assert run("db", "backup", str(out_dir / "b.db"))[0] == 0
    assert run("db", "backup", "--force", str(out_dir / "b.db"))[0] == 0
    assert sorted(os.listdir(out_dir)) == ["b.db"]
    with closing(sqlite3.connect(out_dir / "b.db")) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    (out_dir / "d").mkdir()
    rc, _, err = run("db", "backup", "--force", str(out_dir / "d"))
    assert rc == 2 and "is a directory" in err
    for bad, code in ((out_dir / "missing" / "b.db", 3), ("/proc/self/b.db", 3), ("/proc/b.db", 3),
                      (out_dir / ("n" * 300), 2), ("", 2)):
        rc, _, err = run("db", "backup", str(bad))
        assert rc == code, (bad, err)
    assert sorted(os.listdir(out_dir)) == ["b.db", "d"]
    assert stat.S_ISDIR((out_dir / "d").stat().st_mode)


# -- the licence token ------------------------------------------------------------------------------------------
def _jwt() -> bytes:
    import base64

    def b64(obj: object) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    return f"{b64({'alg': 'RS256', 'typ': 'JWT'})}.{b64({'iss': 'NLS'})}.{b64('sig')}".encode()


def test_token_set_takes_only_a_token_shaped_regular_file(simhost: Path, tmp_path: Path) -> None:
    import socket

    state = tmp_path / "state"
    (tmp_path / "bin.tok").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "passwd.tok").write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/:/usr/sbin/nologin\n")
    (tmp_path / "shadowline.tok").write_text("root:$6$salt$hash:19000:0:99999:7:::\n")
    (tmp_path / "blank.tok").write_text("\n\n")
    (tmp_path / "two.tok").write_text("abc.def\n")
    (tmp_path / "nothdr.tok").write_text("abc.def.ghi\n")
    os.symlink("/etc/passwd", tmp_path / "out.tok")
    os.mkfifo(tmp_path / "fifo.tok")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock.tok"))
    cases = {"bin.tok": "binary", "passwd.tok": "password", "shadowline.tok": "password", "blank.tok": "empty",
             "two.tok": "2 dot-separated", "nothdr.tok": "header", "out.tok": "symbolic link out",
             "fifo.tok": "FIFO", "sock.tok": "socket", "../" * 30 + "etc/passwd": "password"}
    for name, said in cases.items():
        rc, out, err = run("license", "token", "set", str(tmp_path / name))
        assert rc == 2 and said in err, (name, err)
        assert not (state / "licence-token").exists() or not list((state / "licence-token").iterdir())
    for dev in ("/dev/zero", "/dev/null", "/proc/self/mem", "/dev/full"):
        rc, _, err = run("license", "token", "set", dev)
        assert rc in (2, 5) and dev in err, (dev, err)
    rc, _, err = run("license", "token", "set", str(tmp_path / ("n" * 300)))
    assert rc == 2 and "longer than 255" in err
    sock.close()

    (tmp_path / "good.tok").write_bytes(_jwt() + b"\n")
    assert run("license", "token", "set", str(tmp_path / "good.tok"))[0] == 0
    (tmp_path / "odd.tok").write_text("an-opaque-token-from-a-new-dls\n")
    assert run("license", "token", "set", str(tmp_path / "odd.tok"))[0] == 2
    rc, out, _ = run("license", "token", "set", str(tmp_path / "odd.tok"), "--force")
    assert rc == 0 and (state / "licence-token/default.tok").read_text() == "an-opaque-token-from-a-new-dls\n"
    events = json.loads(run("audit", "list", "--json")[1])
    forced = [e for e in events if e["action"] == "licence.token.set" and e["outcome"] == "warning"]
    assert len(forced) == 1 and "not the shape" in forced[0]["detail"]["forced"]
    assert run("license", "token", "set", str(tmp_path / "bin.tok"), "--force")[0] == 0  # the operator's word
    assert run("license", "token", "set", "/dev/zero", "--force")[0] == 2  # still no device


# -- numbers and the other files the issue names ------------------------------------------------------------------
def test_numbers_are_ascii_digits_within_their_bounds_and_go_together(simhost: Path, tmp_path: Path) -> None:
    gpu = "0000:3d:00.0"
    for argv, said in ((["scheduler", "set", gpu, "equal-share", "--timeslice", "٥"], "ASCII digits"),
                       (["scheduler", "set", gpu, "equal-share", "--timeslice", "1_0"], "ASCII digits"),
                       (["scheduler", "set", gpu, "equal-share", "--timeslice", " 5"], "ASCII digits"),
                       (["scheduler", "set", gpu, "equal-share", "--timeslice", "31"], "from 1 to 30"),
                       (["scheduler", "check", "--seconds", "nan"], "not a number"),
                       (["scheduler", "check", "--seconds", "1e9"], "not a number"),
                       (["vendor", "prepare", gpu, "--vfs", "2", "--vf-memory", "1"], "from 512"),
                       (["sim", "create", str(tmp_path / "s"), "--vfs", "-1"], "from 0"),
                       (["vm", "create", "x", "--vgpu", "L40S-2Q", "--memory", "9" * 40], "ASCII digits")):
        rc, _, err = run(*argv)
        assert rc == 2 and said in err, (argv, err)
    for argv in (["scheduler", "set", gpu, "equal-share", "--frequency", "480"],
                 ["scheduler", "set", gpu, "equal-share", "--avg-factor", "3"]):
        rc, _, err = run(*argv)
        assert rc == 2 and "go together" in err
    assert run("scheduler", "set", gpu, "equal-share", "--frequency", "480", "--avg-factor", "3")[0] == 0
    for vfs, code in (("33", 2), ("100000", 2), ("-5", 2), ("4", 0)):
        rc, _, err = run("sim", "create", str(tmp_path / f"s{vfs}"), "--profile", "l40s-vfio", "--vfs", vfs)
        assert rc == code, (vfs, err)
        assert (tmp_path / f"s{vfs}").exists() == (code == 0)
    assert "TotalVFs" in run("sim", "create", str(tmp_path / "t"), "--profile", "l40s-vfio", "--vfs", "33")[2]


def test_scheduler_persist_reads_and_writes_by_the_rules(simhost: Path, tmp_path: Path) -> None:
    assert run("scheduler", "set", "0000:3d:00.0", "equal-share", "--timeslice", "4")[0] == 0
    rc, _, err = run("scheduler", "persist", "--file", "")
    assert rc == 2 and "empty path" in err
    assert not (simhost / "etc/modprobe.d").exists()
    os.mkfifo(tmp_path / "fifo.conf")
    for path, said in (("/dev/zero", "character device"), (str(tmp_path / "fifo.conf"), "FIFO"),
                       (str(tmp_path), "directory"), ("/proc/vgpumgr.conf", "cannot write")):
        rc, _, err = run("scheduler", "persist", "--file", path)
        assert rc in (2, 3, 5) and said in err, (path, err)
    (tmp_path / "theirs.conf").write_text("options nvidia NVreg_X=1\n")
    assert run("scheduler", "persist", "--file", str(tmp_path / "theirs.conf"))[0] == 4
    out_dir = tmp_path / "conf"
    out_dir.mkdir()
    assert run("scheduler", "persist", "--file", str(out_dir / "s.conf"))[0] == 0
    assert run("scheduler", "persist", "--file", str(out_dir / "s.conf"))[0] == 0  # its own file: replaced
    assert os.listdir(out_dir) == ["s.conf"] and "RmPVMRL" in (out_dir / "s.conf").read_text()


def test_sim_create_refuses_what_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    for path, code in ((tmp_path / "file", 2), (tmp_path / "fifo", 2), ("/dev/null", 2), ("/proc/sim", 3),
                       (tmp_path / ("d" * 300), 2), (tmp_path / "file" / "sub", 3), ("", 2)):
        rc, _, err = run("sim", "create", str(path), "--profile", "t4")
        assert rc == code, (path, err)
    assert sorted(os.listdir(tmp_path)) == ["fifo", "file"]


def test_metrics_needs_a_token_on_tcp_unless_the_operator_says_otherwise(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` decides: TCP needs a token for /metrics, `--metrics-public` or a unix socket does not."""
    import uvicorn

    import api.app
    from api import server

    seen: list[bool] = []
    real = api.app.create_app
    monkeypatch.setattr(api.app, "create_app", lambda cfg, metrics_public=False: seen.append(metrics_public) or
                        real(cfg, watch=False, metrics_public=metrics_public))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **k: None)
    root = profiles.create(tmp_path / "host", "t4")
    cfg = server.Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "state"), connect="test:///default")
    server.serve(cfg, port=8471)
    server.serve(cfg, port=8471, metrics_public=True)
    server.serve(cfg, uds=str(tmp_path / "api.sock"))
    assert seen == [False, True, True]
    dbs.dispose_engine(cfg.db_url)
