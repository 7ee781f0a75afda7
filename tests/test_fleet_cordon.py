"""Cordon and uncordon: this host or another sharing the database, through the Service, the CLI and REST,
audited; a cordoned host still runs local commands (with a warning)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from simhost import run
from test_api import make_env, problem

from vgpumgr.audit import chain as audit
from vgpumgr.config import Config
from vgpumgr.errors import InvalidInput, NotFound
from vgpumgr.service import Service
from vgpumgr.sim import profiles


def _service(tmp_path: Path, name: str, db_url: str, monkeypatch: pytest.MonkeyPatch) -> Service:
    root = profiles.create(tmp_path / f"sim-{name}", "t4")
    monkeypatch.setenv("VGPUMGR_HOSTNAME", name)
    return Service(Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / f"state-{name}"), db=db_url))


def _actions(svc: Service) -> list[tuple[str, dict]]:
    with svc.reads() as s:
        return [(e.action, e.detail) for e in audit.query(s, action=None) if e.action.startswith("host.")]


def test_one_host_cordons_another_on_a_shared_database(tmp_path: Path, fresh_db_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    a = _service(tmp_path, "gpu-a", fresh_db_url, monkeypatch)
    b = _service(tmp_path, "gpu-b", fresh_db_url, monkeypatch)
    assert b.host_status() == {"host": "gpu-b", "cordoned": False, "reason": None, "cordoned_by": None,
                               "cordoned_at": None}
    r = a.cordon_host("gpu-b", reason="BIOS update", actor="admin-x")
    assert r["changed"] and r["cordoned"] and r["reason"] == "BIOS update" and r["cordoned_by"] == "admin-x"
    seen = b.host_status()
    assert seen["cordoned"] and seen["reason"] == "BIOS update" and seen["cordoned_by"] == "admin-x"
    assert not a.host_status()["cordoned"]  # only the host named
    assert not a.cordon_host("gpu-b", reason="BIOS update")["changed"]  # the same again changes nothing
    assert a.cordon_host("gpu-b", reason="new PSU")["changed"]  # a new reason replaces the old
    assert b.host_status()["reason"] == "new PSU"
    assert b.uncordon_host()["changed"] and not b.host_status()["cordoned"]
    assert not b.uncordon_host()["changed"]
    assert _actions(a) == [("host.cordon", {"host": "gpu-b", "reason": "BIOS update"}),
                           ("host.cordon", {"host": "gpu-b", "reason": "new PSU", "was": "BIOS update"}),
                           ("host.uncordon", {"host": "gpu-b", "reason": "new PSU"})]
    with pytest.raises(NotFound, match="no host gpu-c"):
        a.cordon_host("gpu-c")
    with pytest.raises(InvalidInput, match="not a host name"):
        a.cordon_host("../etc")
    with pytest.raises(InvalidInput, match="reason"):
        a.cordon_host(reason="x" * 501)
    assert a.verify_audit().ok


def test_cli_cordon_show_uncordon_and_the_warning_on_a_local_create(tmp_path: Path) -> None:
    root = str(profiles.create(tmp_path / "sim", "t4"))
    base = ["--sysfs-root", root, "--state-dir", str(tmp_path / "state")]
    rc, out, _ = run(*base, "host", "show")
    assert rc == 0 and out.endswith(": not cordoned\n")
    rc, out, _ = run(*base, "host", "cordon", "--reason", "BIOS update")
    assert rc == 0 and "cordoned (BIOS update)" in out and "will not choose it" in out
    rc, out, _ = run(*base, "host", "cordon", "--reason", "BIOS update")
    assert rc == 0 and "already cordoned" in out
    rc, out, _ = run(*base, "host", "show", "--json")
    shown = json.loads(out)
    assert rc == 0 and shown["cordoned"] and shown["reason"] == "BIOS update"
    assert shown["cordoned_by"].startswith("cli:")
    # a local create on a cordoned host goes ahead, and says the host is cordoned
    err = io.StringIO()
    old, sys.stderr = sys.stderr, err
    try:
        rc, out, _ = run(*base, "vgpu", "--type", "T4-4Q", "--vm", "web1")
    finally:
        sys.stderr = old
    assert rc == 0 and "created GRID T4-4Q" in out
    assert "is cordoned (BIOS update)" in err.getvalue() and "goes ahead" in err.getvalue()
    rc, _, err_text = run(*base, "host", "cordon", "nosuch")
    assert rc == 3 and "no host nosuch" in err_text
    rc, _, err_text = run(*base, "host", "cordon", "bad name")
    assert rc == 2 and "not a host name" in err_text
    rc, out, _ = run(*base, "host", "uncordon")
    assert rc == 0 and out.endswith("uncordoned\n")
    rc, out, _ = run(*base, "host", "uncordon", "--json")
    assert rc == 0 and json.loads(out)["changed"] is False


def test_rest_cordon_needs_an_operator_and_reads_need_a_reader(tmp_path: Path) -> None:
    env, client = make_env(tmp_path)
    with client:
        r = client.get("/v1/host", headers=env.as_("auditor"))
        assert r.status_code == 200 and r.json()["cordoned"] is False
        problem(client.post("/v1/host/cordon", json={"reason": "x"}, headers=env.as_("auditor")), 403)
        problem(client.post("/v1/host/cordon", json={"reason": "x"}, headers=env.as_("hook")), 403)
        r = client.post("/v1/host/cordon", json={"reason": "BIOS update"}, headers=env.as_("operator"))
        assert r.status_code == 200 and r.json()["cordoned"] and r.json()["cordoned_by"] == "token:ope1"
        assert client.get("/v1/host", headers=env.as_("auditor")).json()["reason"] == "BIOS update"
        problem(client.post("/v1/host/cordon", json={"host": "nosuch"}, headers=env.as_("admin")), 404, "not-found")
        problem(client.post("/v1/host/cordon", json={"host": "a b"}, headers=env.as_("admin")), 400)
        problem(client.post("/v1/host/cordon", json={"bogus": 1}, headers=env.as_("admin")), 422)
        r = client.post("/v1/host/uncordon", json={}, headers=env.as_("admin"))
        assert r.status_code == 200 and r.json()["changed"] and not r.json()["cordoned"]
        # the cordon does not stop this host's own allocations
        r = client.post("/v1/host/cordon", json={}, headers=env.as_("admin"))
        r = client.post("/v1/vgpus", json={"type": "T4-4Q", "vm": "web1"}, headers=env.as_("operator"))
        assert r.status_code == 201, r.text
