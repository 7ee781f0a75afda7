"""Idempotency keys: scoped to the caller, bound to the request (method, path, canonical body), replayed with the
first answer, refused (422 naming the key) for another request or caller, and usable again after they expire."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_api import ApiEnv, make_env, problem

from vgpumgr.ops.idempotency import fingerprint

ALPHA = {"type": "T4-1Q", "vm": "alpha"}


@pytest.fixture
def env(tmp_path: Path) -> ApiEnv:
    e, client = make_env(tmp_path)
    with client:
        yield e


def post(env: ApiEnv, body: dict, key: str, role: str = "operator"):  # noqa: ANN201
    return env.client.post("/v1/vgpus", json=body, headers=env.as_(role, **{"Idempotency-Key": key}))


def test_the_same_request_replays_the_first_answer(env: ApiEnv) -> None:
    first = post(env, ALPHA, "k-1")
    again = post(env, {"vm": "alpha", "type": "T4-1Q"}, "k-1")  # key order does not matter
    assert first.status_code == again.status_code == 201
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert len(env.service.allocations(live=True)) == 1


def test_the_key_with_another_body_is_refused_naming_the_key(env: ApiEnv) -> None:
    alpha = post(env, ALPHA, "k-1").json()
    body = problem(post(env, {"type": "T4-2Q", "vm": "beta"}, "k-1"), 422, "idempotency-key-reused")
    assert body["idempotency_key"] == "k-1" and "'k-1'" in body["detail"] and "different request" in body["detail"]
    assert alpha["uuid"] not in str(body)
    assert [a["vm"] for a in env.service.allocations(live=True)] == ["alpha"]


def test_the_key_of_another_caller_is_refused(env: ApiEnv) -> None:
    alpha = post(env, ALPHA, "k-1").json()
    for body in (ALPHA, {"type": "T4-1Q", "vm": "gamma"}):
        refused = problem(post(env, body, "k-1", role="hook"), 422, "idempotency-key-reused")
        assert "another caller" in refused["detail"] and alpha["uuid"] not in str(refused)
    assert post(env, ALPHA, "k-1", role="admin").status_code == 422


def test_a_key_may_be_reused_after_it_expires(env: ApiEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPUMGR_IDEMPOTENCY_TTL", "1")
    alpha = post(env, ALPHA, "k-1").json()
    assert post(env, ALPHA, "k-1").json() == alpha
    time.sleep(1.1)
    beta = post(env, {"type": "T4-1Q", "vm": "beta"}, "k-1")
    assert beta.status_code == 201 and beta.json()["uuid"] != alpha["uuid"]
    monkeypatch.setenv("VGPUMGR_IDEMPOTENCY_TTL", "soon")
    body = problem(post(env, ALPHA, "k-2"), 400, "invalid-input")
    assert "VGPUMGR_IDEMPOTENCY_TTL" in body["detail"]


def test_a_failed_request_does_not_use_the_key_up(env: ApiEnv) -> None:
    problem(post(env, {"type": "T4-16Q", "vm": "big", "policy": {"pin_gpu": "0000:99:00.0"}}, "k-3"), 409)
    assert post(env, {"type": "T4-16Q", "vm": "big"}, "k-3").status_code == 201


def test_vm_create_replays_too(env: ApiEnv) -> None:
    h = env.as_("operator", **{"Idempotency-Key": "vm-1"})
    first = env.client.post("/v1/vms", json={"name": "v1", "vgpus": ["T4-1Q"]}, headers=h)
    again = env.client.post("/v1/vms", json={"name": "v1", "vgpus": ["T4-1Q"]}, headers=h)
    assert first.status_code == again.status_code == 201 and again.json() == first.json()
    problem(env.client.post("/v1/vms", json={"name": "v2", "vgpus": ["T4-1Q"]}, headers=h), 422)


def test_fingerprint_is_canonical() -> None:
    assert fingerprint("post", "/v1/vgpus", {"a": 1, "b": [1, 2]}) == fingerprint("POST", "/v1/vgpus",
                                                                                 {"b": [1, 2], "a": 1})
    assert fingerprint("POST", "/v1/vgpus", {"a": 1}) != fingerprint("POST", "/v1/vms", {"a": 1})
    assert fingerprint("POST", "/v1/vgpus", {"a": 1}) != fingerprint("POST", "/v1/vgpus", {"a": 2})


def test_cli_key_is_the_actors_and_bound_to_the_arguments(env: ApiEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    from simhost import run

    args = ["--sysfs-root", str(env.cfg.host.root), "--state-dir", str(env.cfg.state_dir), "--connect",
            env.cfg.libvirt_uri]
    monkeypatch.setenv("VGPUMGR_ACTOR", "cli:alice")
    rc, first, _ = run(*args, "vgpu", "--type", "T4-1Q", "--vm", "a", "--idempotency-key", "c-1", "--json")
    rc2, again, _ = run(*args, "vgpu", "--type", "T4-1Q", "--vm", "a", "--idempotency-key", "c-1", "--json")
    assert rc == rc2 == 0 and first == again
    rc, _, err = run(*args, "vgpu", "--type", "T4-2Q", "--vm", "a", "--idempotency-key", "c-1")
    assert rc == 2 and "'c-1'" in err and "different request" in err
    monkeypatch.setenv("VGPUMGR_ACTOR", "cli:bob")
    rc, _, err = run(*args, "vgpu", "--type", "T4-1Q", "--vm", "a", "--idempotency-key", "c-1")
    assert rc == 2 and "another caller" in err
    assert len(env.service.allocations(live=True)) == 1


@pytest.mark.parametrize("raw", ["0", "-5", "soon", "nan"])
def test_expiry_and_lease_settings_refuse_what_is_not_a_positive_number(monkeypatch: pytest.MonkeyPatch,
                                                                         raw: str) -> None:
    from vgpumgr.errors import InvalidInput
    from vgpumgr.ops import idempotency, leases

    for env, read in ((idempotency.TTL_ENV, idempotency.ttl_seconds), (leases.LEASE_ENV, leases.lease_seconds)):
        monkeypatch.setenv(env, raw)
        with pytest.raises(InvalidInput, match=f"{env}=.*not a positive number of seconds"):
            read()
        monkeypatch.setenv(env, "90")
        assert read() == 90.0
