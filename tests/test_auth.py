"""Bearer tokens and roles: 401 without a valid token, 403 for the wrong role, the token's name in the audit."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from test_api import GPU, ApiEnv, make_env, problem

from api import tokens
from vgpumgr.errors import Conflict, InvalidInput, NotFound

UUID = "00000000-0000-0000-0000-000000000001"
# (method, path, body) -> roles allowed; every other role must get 403.
MATRIX = [
    ("get", "/v1/gpus", None, {"admin", "operator", "auditor"}),
    ("get", "/v1/types", None, {"admin", "operator", "auditor"}),
    ("get", "/v1/devices", None, {"admin", "operator", "auditor"}),
    ("get", "/v1/vgpus?vm=x", None, {"admin", "operator", "auditor", "hook"}),
    ("get", "/v1/placements", None, {"admin", "operator", "auditor"}),
    ("post", "/v1/placements/preview", {"type": "T4-1Q"}, {"admin", "operator", "auditor"}),
    ("post", "/v1/vgpus", {"type": "NOPE-1Q", "vm": "x"}, {"admin", "operator", "hook"}),
    ("delete", f"/v1/vgpus/{UUID}", None, {"admin", "operator", "hook"}),
    ("post", "/v1/hooks/release", {"vm": "x"}, {"admin", "operator", "hook"}),
    ("get", "/v1/vms", None, {"admin", "operator", "auditor"}),
    ("post", "/v1/vms", {"name": "x", "vgpus": ["NOPE-1Q"]}, {"admin", "operator"}),
    ("post", "/v1/vms/x/start", None, {"admin", "operator"}),
    ("delete", "/v1/vms/x", None, {"admin", "operator"}),
    ("get", "/v1/licences", None, {"admin", "operator", "auditor"}),
    ("post", "/v1/licences", {"name": "p", "edition": "gold", "seats": 1}, {"admin"}),
    ("delete", "/v1/licences/none", None, {"admin"}),
    ("get", "/v1/audit", None, {"admin", "operator", "auditor"}),
    ("get", "/v1/audit/verify", None, {"admin", "operator", "auditor"}),
    ("post", "/v1/reconcile", {"fix": False}, {"admin"}),
    ("get", "/v1/tokens", None, {"admin"}),
]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> ApiEnv:
    e, client = make_env(tmp_path_factory.mktemp("auth"))
    with client:
        yield e


@pytest.mark.parametrize("method,path,body,allowed", MATRIX, ids=[f"{m} {p}" for m, p, _, _ in MATRIX])
def test_role_matrix(env: ApiEnv, method: str, path: str, body: dict | None, allowed: set[str]) -> None:
    problem(env.client.request(method, path, json=body), 401, "unauthorized")
    for role in tokens.ROLES:
        r = env.client.request(method, path, json=body, headers=env.as_(role))
        if role in allowed:
            assert r.status_code not in (401, 403), (role, r.text)
        else:
            assert role in problem(r, 403, "permission-denied")["detail"]


def test_bad_revoked_and_malformed_tokens(tmp_path: Path) -> None:
    env, client = make_env(tmp_path)
    with client:
        problem(client.get("/v1/gpus", headers={"Authorization": "Bearer vgm_guess"}), 401)
        problem(client.get("/v1/gpus", headers={"Authorization": "Basic dXNlcjpwdw=="}), 401)
        problem(client.get("/v1/gpus", headers={"Authorization": "Bearer " + "x" * 5000}), 401)
        assert client.get("/v1/gpus", headers=env.as_("auditor")).status_code == 200
        tokens.revoke_token(env.cfg, "aud1")
        assert "revoked" in problem(client.get("/v1/gpus", headers=env.as_("auditor")), 401)["detail"]
        with pytest.raises(NotFound):
            tokens.revoke_token(env.cfg, "aud1")
        assert [t["name"] for t in tokens.list_tokens(env.cfg)] == ["adm1", "ope1", "hoo1"]
        assert "aud1" in [t["name"] for t in tokens.list_tokens(env.cfg, include_revoked=True)]
        listed = client.get("/v1/tokens", headers=env.as_("admin")).json()
        assert {t["role"] for t in listed} == {"admin", "operator", "hook"}


def test_token_creation_rules_and_hashed_storage(tmp_path: Path) -> None:
    env, client = make_env(tmp_path)
    secret = tokens.create_token(env.cfg, "ci", "operator")
    assert secret.startswith(tokens.PREFIX) and len(secret) > 40
    assert tokens.create_token(env.cfg, "ci2", "operator") != secret
    with pytest.raises(Conflict):
        tokens.create_token(env.cfg, "ci", "admin")
    with pytest.raises(InvalidInput):
        tokens.create_token(env.cfg, "x", "root")
    with pytest.raises(InvalidInput):
        tokens.create_token(env.cfg, "bad name", "admin")
    db = sqlite3.connect(env.cfg.db_url.removeprefix("sqlite:///"))
    rows = db.execute("SELECT name, secret_sha256 FROM api_tokens").fetchall()
    db.close()
    assert ("ci", tokens.digest(secret)) in rows
    assert all(secret not in h for _, h in rows)


def test_hook_role_is_limited_to_a_vms_vgpus(env: ApiEnv) -> None:
    h = env.as_("hook")
    problem(env.client.post("/v1/vgpus", json={"type": "T4-1Q"}, headers=h), 403)
    problem(env.client.get("/v1/vgpus", headers=h), 403)
    free = env.client.post("/v1/vgpus", json={"type": "T4-1Q"}, headers=env.as_("operator")).json()
    assert "belongs to no VM" in problem(env.client.delete(f"/v1/vgpus/{free['uuid']}", headers=h), 403)["detail"]
    mine = env.client.post("/v1/vgpus", json={"type": "T4-1Q", "vm": "hv"}, headers=h)
    assert mine.status_code == 201
    problem(env.client.delete(f"/v1/vgpus/{mine.json()['uuid']}", headers=h), 400)  # a hook names the owner
    owner = {"vm": "hv", "allocation_id": mine.json()["id"]}
    assert env.client.delete(f"/v1/vgpus/{mine.json()['uuid']}", params=owner, headers=h).status_code == 200
    env.client.delete(f"/v1/vgpus/{free['uuid']}", headers=env.as_("operator"))


def test_mutations_are_audited_with_the_token_name(env: ApiEnv) -> None:
    a = env.client.post("/v1/vgpus", json={"type": "T4-2Q", "vm": "who"}, headers=env.as_("operator")).json()
    env.client.delete(f"/v1/vgpus/{a['uuid']}", params={"vm": "who", "allocation_id": a["id"]},
                      headers=env.as_("hook"))
    env.client.post("/v1/licences", json={"name": "pool-a", "edition": "vPC", "seats": 2}, headers=env.as_("admin"))
    events = env.client.get("/v1/audit", params={"vgpu": a["uuid"]}, headers=env.as_("auditor")).json()
    by_action = {e["action"]: e["actor"] for e in events}
    assert by_action["vgpu.create"] == "token:ope1" and by_action["vgpu.remove"] == "token:hoo1"
    pool = env.client.get("/v1/audit", params={"action": "licence.pool.add"}, headers=env.as_("auditor")).json()
    assert [e["actor"] for e in pool] == ["token:adm1"]
    assert env.client.get(f"/v1/gpus/{GPU}", headers=env.as_("operator")).status_code == 200
