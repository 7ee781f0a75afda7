"""`GET /v1/host/doctor` and the web view's doctor page (issue 38): any role reads them; a FAIL shows with its
hint and `ok` false."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_api import ApiEnv, make_env
from test_ui import login

from vgpumgr.sim.host_platform import break_state


@pytest.fixture
def env(tmp_path: Path) -> ApiEnv:
    e, client = make_env(tmp_path, "mixed")
    with client:
        yield e


def test_any_role_reads_the_doctor_and_a_fail_comes_with_its_hint(env: ApiEnv) -> None:
    assert env.client.get("/v1/host/doctor").status_code == 401
    for role in ("auditor", "operator", "admin"):
        body = env.client.get("/v1/host/doctor", headers=env.as_(role)).json()
        assert body["ok"] and body["summary"]["fail"] == 0, role
    break_state(env.cfg.host.root, "vfs-off", "0000:3d:00.0")
    body = env.client.get("/v1/host/doctor", params={"gpu": "0000:3d:00.0"}, headers=env.as_("auditor")).json()
    fail = [r for r in body["results"] if r["level"] == "FAIL"]
    assert not body["ok"] and [r["key"] for r in fail] == ["gpu.vfs"]
    assert "sriov-manage -e 0000:3d:00.0" in fail[0]["hint"]
    assert env.client.get("/v1/host/doctor", params={"gpu": "nope"}, headers=env.as_("auditor")).status_code == 400
    page = login(env, "auditor").get("/ui/doctor")
    assert page.status_code == 200 and "FAIL: 1" in page.text and "sriov-manage -e 0000:3d:00.0" in page.text
    assert 'href="/ui/doctor"' in page.text
