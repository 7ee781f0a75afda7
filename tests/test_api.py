"""The REST API through FastAPI's TestClient on a simulated T4 host: every endpoint and its errors."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api import tokens
from api.app import create_app
from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.config import Config
from vgpumgr.service import Service
from vgpumgr.sim import profiles

GPU = "0000:3b:00.0"
PROBLEM = "application/problem+json"


@dataclass
class ApiEnv:
    client: TestClient
    service: Service
    cfg: Config
    headers: dict[str, dict[str, str]]  # role -> Authorization header

    def as_(self, role: str, **extra: str) -> dict[str, str]:
        return {**self.headers[role], **extra}


def make_env(tmp_path: Path, profile: str = "t4", scale: int = 1) -> tuple[ApiEnv, TestClient]:
    root = profiles.create(tmp_path / "sim", profile, scale=scale)
    testhost = tmp_path / "testhost.xml"
    testhost.write_text("<node><cpu><mode>host-passthrough</mode></cpu></node>\n")
    cfg = Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "state"), connect=f"test://{testhost}")
    svc = Service(cfg)
    headers = {role: {"Authorization": f"Bearer {tokens.create_token(cfg, role[:3] + '1', role)}"}
               for role in tokens.ROLES}
    client = TestClient(create_app(service=svc), raise_server_exceptions=False)
    return ApiEnv(client, svc, cfg, headers), client


@pytest.fixture
def env(tmp_path: Path) -> ApiEnv:
    e, client = make_env(tmp_path)
    with client:
        yield e


def problem(r, status: int, kind: str | None = None) -> dict:  # noqa: ANN001
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith(PROBLEM)
    body = r.json()
    assert body["status"] == status and body["title"] and body["detail"]
    if kind:
        assert body["type"].endswith("/" + kind), body
    return body


def test_health_needs_no_token_and_data_endpoints_do(env: ApiEnv) -> None:
    r = env.client.get("/v1/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["gpus"] == 1
    assert r.json()["inventory_updates"] == "ttl"  # a simulated root never gets udev events
    body = problem(env.client.get("/v1/gpus"), 401, "unauthorized")
    assert "Bearer" in body["hint"]
    assert env.client.get("/v1/gpus").headers["www-authenticate"] == "Bearer"
    assert env.client.get("/docs").status_code == 200
    assert "/v1/vgpus" in env.client.get("/openapi.json").json()["paths"]


def test_gpus_types_and_devices(env: ApiEnv) -> None:
    h = env.as_("auditor")
    gpus = env.client.get("/v1/gpus", headers=h).json()
    assert [g["address"] for g in gpus] == [GPU] and "mdev" in gpus[0]["backends"]
    one = env.client.get(f"/v1/gpus/{GPU}", headers=h).json()
    assert one["address"] == GPU and any(t["name"] == "GRID T4-4Q" for t in one["types"])
    assert env.client.get("/v1/gpus/3b:00.0", headers=h).json()["address"] == GPU  # short form accepted
    problem(env.client.get("/v1/gpus/0000:99:00.0", headers=h), 404, "not-found")
    assert "PCI address" in problem(env.client.get("/v1/gpus/zzz", headers=h), 400, "invalid-input")["detail"]
    types = env.client.get("/v1/types", params={"gpu": GPU, "available": True}, headers=h).json()
    assert types and all(t["gpu"] == GPU and t["available_instances"] > 0 for t in types)
    assert env.client.get("/v1/types", params={"parent": "0000:3c:00.0"}, headers=h).json() == []
    problem(env.client.get("/v1/types", params={"parent": "../etc"}, headers=h), 400)


def test_refresh_rereads_sysfs(env: ApiEnv) -> None:
    h = env.as_("auditor")
    assert env.client.get("/v1/devices", headers=h).json()["mdevs"] == []
    env.service.snapshot_ttl = 3600.0  # only an explicit refresh can show the change below
    made = mdev_backend.create(env.cfg.host, GPU, "nvidia-232")  # behind the service's back
    assert env.client.get("/v1/devices", headers=h).json()["mdevs"] == []
    fresh = env.client.get("/v1/devices", params={"refresh": 1}, headers=h).json()["mdevs"]
    assert [m["uuid"] for m in fresh] == [made.uuid]


def test_vgpu_create_get_list_delete(env: ApiEnv) -> None:
    h = env.as_("operator")
    r = env.client.post("/v1/vgpus", json={"type": "T4-4Q", "vm": "web1"}, headers=h)
    assert r.status_code == 201, r.text
    a = r.json()
    assert a["type_name"] == "GRID T4-4Q" and a["vm"] == "web1" and a["state"] == "active" and a["gpu"] == GPU
    assert env.client.get(f"/v1/vgpus/{a['uuid']}", headers=h).json()["id"] == a["id"]
    assert [x["uuid"] for x in env.client.get("/v1/vgpus", params={"vm": "web1"}, headers=h).json()] == [a["uuid"]]
    assert env.client.get("/v1/vgpus", params={"vm": "other"}, headers=h).json() == []
    assert [x["uuid"] for x in env.client.get("/v1/placements", headers=h).json()] == [a["uuid"]]
    d = env.client.delete(f"/v1/vgpus/{a['uuid']}", headers=h)
    assert d.status_code == 200 and d.json()["state"] == "released"
    assert env.client.get("/v1/vgpus", headers=h).json() == []
    released = env.client.get("/v1/vgpus", params={"state": "released"}, headers=h).json()
    assert [x["uuid"] for x in released] == [a["uuid"]]
    problem(env.client.delete(f"/v1/vgpus/{a['uuid']}", headers=h), 404, "not-found")
    problem(env.client.get("/v1/vgpus/not-a-uuid", headers=h), 400, "invalid-input")
    problem(env.client.get("/v1/vgpus", params={"state": "bogus"}, headers=h), 422)


def test_vgpu_with_given_uuid_and_pinned_parent(env: ApiEnv) -> None:
    uuid = "00000001-0000-0000-0000-000000000100"
    body = {"type": "nvidia-232", "vm": "a", "uuid": uuid, "policy": {"pin_parent": GPU, "strategy": "spread"}}
    r = env.client.post("/v1/vgpus", json=body, headers=env.as_("admin"))
    assert r.status_code == 201 and r.json()["uuid"] == uuid
    assert uuid in [m.uuid for m in env.service.snapshot(refresh=True).inventory.mdevs]
    again = env.client.post("/v1/vgpus", json={**body, "vm": "b"}, headers=env.as_("admin"))
    assert "already" in problem(again, 409)["detail"]
    bad_pin = {"type": "T4-4Q", "policy": {"pin_parent": "0000:99:00.0"}}
    problem(env.client.post("/v1/vgpus", json=bad_pin, headers=env.as_("admin")), 409, "no-capacity")


def test_idempotency_key_returns_the_same_vgpu(env: ApiEnv) -> None:
    h = env.as_("operator", **{"Idempotency-Key": "req-42"})
    first = env.client.post("/v1/vgpus", json={"type": "T4-2Q", "vm": "k"}, headers=h).json()
    second = env.client.post("/v1/vgpus", json={"type": "T4-2Q", "vm": "k"}, headers=h).json()
    assert first == second and second["idempotency_key"]  # the replayed first answer (tests/test_idempotency.py)
    assert len(env.client.get("/v1/vgpus", headers=h).json()) == 1
    bad = env.as_("operator", **{"Idempotency-Key": "  "})
    problem(env.client.post("/v1/vgpus", json={"type": "T4-2Q"}, headers=bad), 400, "invalid-input")


def test_no_capacity_is_409_with_reasons(env: ApiEnv) -> None:
    h = env.as_("operator")
    assert env.client.post("/v1/vgpus", json={"type": "T4-16Q"}, headers=h).status_code == 201
    body = problem(env.client.post("/v1/vgpus", json={"type": "T4-16Q"}, headers=h), 409, "no-capacity")
    assert body["hint"] and body["rejected"] and body["rejected"][0]["parent"] == GPU


def test_bad_input_is_4xx_never_500(env: ApiEnv) -> None:
    h = env.as_("admin")
    assert "not a vGPU type" in problem(env.client.post("/v1/vgpus", json={"type": " "}, headers=h), 400)["detail"]
    problem(env.client.post("/v1/vgpus", json={"type": "NOPE-1Q"}, headers=h), 404)
    body = problem(env.client.post("/v1/vgpus", json={"typo": "T4-1Q"}, headers=h), 422, "invalid-request")
    assert {tuple(e["loc"]) for e in body["errors"]} == {("body", "type"), ("body", "typo")}
    problem(env.client.post("/v1/vgpus", content=b"{not json", headers={**h, "Content-Type": "application/json"}),
            422)
    problem(env.client.post("/v1/vgpus", json={"type": "T4-1Q", "vm": "bad name!"}, headers=h), 400)
    problem(env.client.post("/v1/vgpus", json={"type": "T4-1Q", "uuid": "123"}, headers=h), 400)
    problem(env.client.post("/v1/vgpus", json={"type": "T4-1Q", "policy": {"numa": -1}}, headers=h), 422)
    problem(env.client.post("/v1/vgpus", json={"type": "T4-1Q", "policy": {"pin_gpu": "x"}}, headers=h), 400)
    problem(env.client.get("/v1/nothing-here", headers=h), 404)
    problem(env.client.put("/v1/vgpus", headers=h), 405)


def test_passthrough(env: ApiEnv) -> None:
    h = env.as_("operator")
    env.client.post("/v1/vgpus", json={"type": "T4-1Q"}, headers=h)
    busy = problem(env.client.post("/v1/vgpus/passthrough", json={"address": GPU, "vm": "p"}, headers=h), 409)
    assert "vGPUs" in busy["detail"]
    problem(env.client.post("/v1/vgpus/passthrough", json={"address": "0000:99:00.0"}, headers=h), 404)


def test_placement_preview_changes_nothing(env: ApiEnv) -> None:
    h = env.as_("auditor")
    r = env.client.post("/v1/placements/preview", json={"type": "T4-8Q", "policy": {"strategy": "spread"}},
                        headers=h)
    assert r.status_code == 200
    d = r.json()
    assert d["choice"]["parent"] == GPU and d["choice"]["name"] == "GRID T4-8Q" and d["policy"]["strategy"] == "spread"
    assert env.client.get("/v1/placements", headers=h).json() == []
    problem(env.client.post("/v1/placements/preview", json={"type": "T4-8Q", "policy": {"strategy": "x"}},
                            headers=h), 422)


def test_vm_lifecycle(tmp_path: Path) -> None:
    env, client = make_env(tmp_path, scale=2)
    with client:
        _vm_lifecycle(env)


def _vm_lifecycle(env: ApiEnv) -> None:
    h = env.as_("operator")
    dry = env.client.post("/v1/vms", json={"name": "vm1", "vgpus": ["T4-4Q"], "print_xml": True}, headers=h)
    assert dry.status_code == 200, dry.text
    assert "<domain" in dry.json()["xml"] and env.client.get("/v1/placements", headers=h).json() == []
    r = env.client.post("/v1/vms", json={"name": "vm1", "vgpus": ["T4-4Q"], "memory_mib": 2048}, headers=h)
    assert r.status_code == 201, r.text
    assert [x["name"] for x in env.client.get("/v1/vms", headers=h).json()].count("vm1") == 1
    vm = env.client.get("/v1/vms/vm1", headers=h).json()
    assert len(vm["allocations"]) == 1 and vm["allocations"][0]["type_name"] == "GRID T4-4Q"
    x = env.client.get("/v1/vms/vm1/xml", headers=h)
    assert x.headers["content-type"].startswith("application/xml") and vm["allocations"][0]["uuid"] in x.text
    assert env.client.post("/v1/vms/vm1/start", headers=h).status_code == 200
    assert env.client.get("/v1/vms/vm1", headers=h).json()["state"] == "running"
    assert env.client.post("/v1/vms/vm1/stop", headers=h).status_code == 200
    att = env.client.post("/v1/vms/vm1/vgpus", json={"type": "T4-4Q"}, headers=h)
    assert att.status_code == 201, att.text
    gpus = {a["gpu"] for a in env.client.get("/v1/vms/vm1", headers=h).json()["allocations"]}
    assert len(gpus) == 2  # NVIDIA allows one vGPU per GPU per VM, so the second went to the other GPU
    problem(env.client.post("/v1/vms/vm1/vgpus", json={"type": "T4-4Q"}, headers=h), 409, "no-capacity")
    problem(env.client.delete(f"/v1/vms/other/vgpus/{att.json()['uuid']}", headers=h), 409)  # not its vGPU
    det = env.client.delete(f"/v1/vms/vm1/vgpus/{att.json()['uuid']}", headers=h)
    assert det.status_code == 200 and det.json()["state"] == "released"
    problem(env.client.post("/v1/vms", json={"name": "vm1", "vgpus": ["T4-1Q"]}, headers=h), 409)
    assert env.client.delete("/v1/vms/vm1", headers=h).status_code == 200
    assert env.client.get("/v1/placements", headers=h).json() == []
    for method, path in (("get", "/v1/vms/vm1"), ("get", "/v1/vms/vm1/xml"), ("post", "/v1/vms/vm1/start")):
        problem(env.client.request(method, path, headers=h), 404)
    assert env.client.delete("/v1/vms/vm1", headers=h).json()["released"] == []  # deleting twice is harmless
    problem(env.client.get("/v1/vms/bad%20name", headers=h), 400)
    problem(env.client.post("/v1/vms", json={"name": "v", "firmware": "uefi"}, headers=h), 422)


def test_licences(env: ApiEnv) -> None:
    h = env.as_("admin")
    pool = {"name": "ws", "edition": "vws", "seats": 1, "unit": "vm", "expires": "2099-01-01"}
    r = env.client.post("/v1/licences", json=pool, headers=h)
    assert r.status_code == 201 and r.json()["edition"] == "vWS"
    problem(env.client.post("/v1/licences", json=pool, headers=h), 409)
    problem(env.client.post("/v1/licences", json={**pool, "name": "x", "edition": "gold"}, headers=h), 400)
    env.client.post("/v1/vgpus", json={"type": "T4-4Q", "vm": "lic"}, headers=h)
    usage = env.client.get("/v1/licences/usage", headers=h).json()
    (ws,) = usage["editions"]
    assert (ws["edition"], ws["seats"], ws["used"], ws["free"]) == ("vWS", 1, 1, 0)
    assert ws["holders"][0]["vm"] == "lic"
    changed = env.client.patch("/v1/licences/ws", json={"seats": 3, "clear_expiry": True}, headers=h).json()
    assert changed["seats"] == 3 and changed["expires"] is None
    assert "in use" in problem(env.client.delete("/v1/licences/ws", headers=h), 409)["detail"]
    problem(env.client.patch("/v1/licences/none", json={"seats": 1}, headers=h), 404)
    assert [p["name"] for p in env.client.get("/v1/licences", headers=h).json()] == ["ws"]
    for a in env.client.get("/v1/vgpus", headers=h).json():
        env.client.delete(f"/v1/vgpus/{a['uuid']}", headers=h)
    assert env.client.delete("/v1/licences/ws", headers=h).json() == {"removed": "ws"}
    assert env.client.get("/v1/licences", headers=h).json() == []


def test_audit_filters_export_and_verify(env: ApiEnv) -> None:
    env.client.post("/v1/vgpus", json={"type": "T4-1Q", "vm": "aud"}, headers=env.as_("operator"))
    env.client.post("/v1/vgpus", json={"type": "NOPE-1Q", "vm": "aud"}, headers=env.as_("admin"))
    h = env.as_("auditor")
    events = env.client.get("/v1/audit", params={"actor": "token:ope1"}, headers=h).json()
    assert {e["action"] for e in events} >= {"placement", "vgpu.create"}
    assert all(e["actor"] == "token:ope1" and e["vm"] == "aud" for e in events)
    newest = env.client.get("/v1/audit", params={"newest_first": True, "limit": 1}, headers=h).json()
    assert len(newest) == 1 and newest[0]["seq"] == max(e["seq"] for e in events)
    assert env.client.get("/v1/audit", params={"since": "2999-01-01T00:00:00Z"}, headers=h).json() == []
    csv = env.client.get("/v1/audit", params={"format": "csv", "action": "vgpu.create"}, headers=h)
    assert csv.headers["content-type"].startswith("text/csv")
    lines = csv.text.strip().splitlines()
    assert lines[0].startswith("seq,at,host,actor,action") and len(lines) == 2 and "token:ope1" in lines[1]
    problem(env.client.get("/v1/audit", params={"format": "xml"}, headers=h), 422)
    problem(env.client.get("/v1/audit", params={"since": "yesterday"}, headers=h), 422)
    v = env.client.get("/v1/audit/verify", headers=h).json()
    assert v["ok"] is True and v["checked"] == v["head_seq"] >= 2
    with env.service.tx() as s:  # tamper with one event: verify must name it
        s.connection().exec_driver_sql("UPDATE audit_events SET vm = 'evil' WHERE seq = 1")
    bad = env.client.get("/v1/audit/verify", headers=h).json()
    assert bad["ok"] is False and bad["problems"][0]["seq"] == 1


def test_reconcile_report_and_fix(env: ApiEnv) -> None:
    a = env.client.post("/v1/vgpus", json={"type": "T4-2Q", "vm": "r"}, headers=env.as_("admin")).json()
    mdev_backend.remove(env.cfg.host, a["uuid"])  # a host reboot, in effect
    report = env.client.get("/v1/reconcile", headers=env.as_("auditor")).json()
    assert report["missing"] == [a["uuid"]] and report["fixed"] is False
    fixed = env.client.post("/v1/reconcile", json={"fix": True}, headers=env.as_("admin")).json()
    assert fixed["restored"] == [a["uuid"]]
    assert a["uuid"] in [m.uuid for m in env.service.snapshot(refresh=True).inventory.mdevs]
    problem(env.client.post("/v1/reconcile", json={"fix": "maybe"}, headers=env.as_("admin")), 422)


def _sample(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # the exposition sorts labels
    m = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M) if labels else \
        re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m[1]) if m else None


def test_metrics(env: ApiEnv) -> None:
    h = env.as_("admin")
    env.client.post("/v1/licences", json={"name": "p", "edition": "vWS", "seats": 4}, headers=h)
    for vm in ("m1", "m2"):
        assert env.client.post("/v1/vgpus", json={"type": "T4-4Q", "vm": vm}, headers=h).status_code == 201
    assert env.client.get("/metrics").status_code == 401  # TCP: a token of any role (serve --metrics-public)
    assert env.client.get("/metrics", headers=env.as_("hook")).status_code == 200
    text = env.client.get("/metrics", headers=env.as_("auditor")).text
    assert _sample(text, "vgpumgr_gpus", model=env.service.snapshot().inventory.gpus[0].name) == 1
    assert _sample(text, "vgpumgr_vgpus", type="GRID T4-4Q", state="active") == 2
    assert _sample(text, "vgpumgr_licence_seats_used", edition="vWS") == 2
    assert _sample(text, "vgpumgr_licence_seats_free", edition="vWS") == 2
    assert _sample(text, "vgpumgr_allocation_seconds_count") == 2
    assert _sample(text, "vgpumgr_allocation_seconds_bucket", le="+Inf") == 2


def test_fleet_place_and_publish_latency_histograms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPUMGR_FLEET_PUBLISH", "1")  # every change publishes (the default on PostgreSQL only)
    e, client = make_env(tmp_path)
    with client:
        h, read = e.as_("admin"), e.as_("auditor")

        def scrape(name: str, **labels: str) -> float | None:
            return _sample(client.get("/metrics", headers=read).text, name, host=e.service.hostname, **labels)

        for result in ("placed", "no_room", "error"):  # every series there from the start
            assert scrape("vgpumgr_fleet_place_seconds_count", result=result) == 0
        assert scrape("vgpumgr_fleet_publish_seconds_count", kind="change") == 0
        full = scrape("vgpumgr_fleet_publish_seconds_count", kind="full")  # serve's first heartbeat writes it all
        assert client.post("/v1/fleet/publish", headers=h).status_code == 200
        assert scrape("vgpumgr_fleet_publish_seconds_count", kind="full") == (full or 0) + 1
        assert client.post("/v1/vgpus", json={"type": "T4-4Q", "vm": "m1"}, headers=h).status_code == 201
        changes = scrape("vgpumgr_fleet_publish_seconds_count", kind="change")
        assert changes is not None and changes >= 1
        assert 0 < (scrape("vgpumgr_fleet_publish_seconds_sum", kind="change") or 0) < 10 * changes

        def broken(*_: object) -> None:
            raise RuntimeError("no metrics today")

        observe, e.service.fleet.observe = e.service.fleet.observe, broken  # a metric never fails the change
        made = client.post("/v1/vgpus", json={"type": "T4-4Q", "vm": "m2"}, headers=h)
        assert made.status_code == 201 and made.json()["state"] == "active"
        assert client.delete(f"/v1/vgpus/{made.json()['uuid']}", headers=h).status_code in (200, 204)
        e.service.fleet.observe = observe

        ok = client.get("/v1/fleet/place", params={"type": "T4-4Q"}, headers=read)
        assert ok.status_code == 200 and ok.json()["choice"]["host"] == e.service.hostname
        no_room = client.get("/v1/fleet/place", params={"type": "T4-16Q"}, headers=read)  # the T4 holds a 4Q
        assert no_room.status_code == 200 and no_room.json()["choice"] is None
        problem(client.get("/v1/fleet/place", params={"type": "T4-2Q", "vm": "m1"}, headers=read), 400)
        problem(client.get("/v1/fleet/place", params={"type": "T4-4Q", "count": 0}, headers=read), 422)  # uncounted
        nowhere = client.get("/v1/fleet/place", params={"type": "X9-1Q"}, headers=read)  # no host offers it
        assert nowhere.status_code == 200 and nowhere.json()["choice"] is None
        assert scrape("vgpumgr_fleet_place_seconds_count", result="placed") == 1
        assert scrape("vgpumgr_fleet_place_seconds_count", result="no_room") == 2
        assert scrape("vgpumgr_fleet_place_seconds_count", result="error") == 1
        assert scrape("vgpumgr_fleet_place_seconds_bucket", result="placed", le="5.0") == 1


def test_hook_ensure_is_idempotent_and_recreates_after_reboot(env: ApiEnv) -> None:
    h = env.as_("hook")
    body = {"uuid": "00000000-0000-0000-0000-000000000101", "type": "nvidia-232", "vm": "pve-101", "parent": GPU}
    first = env.client.post("/v1/hooks/ensure", json=body, headers=h)
    assert first.status_code == 201, first.text
    again = env.client.post("/v1/hooks/ensure", json=body, headers=h)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    mdev_backend.remove(env.cfg.host, body["uuid"])  # host reboot: record lives, device gone
    redo = env.client.post("/v1/hooks/ensure", json=body, headers=h)
    assert redo.status_code == 201 and redo.json()["uuid"] == body["uuid"] and redo.json()["id"] != first.json()["id"]
    assert body["uuid"] in [m.uuid for m in env.service.snapshot(refresh=True).inventory.mdevs]
    assert "belongs to VM pve-101" in problem(env.client.post("/v1/hooks/ensure", json={**body, "vm": "x"},
                                                              headers=h), 409)["detail"]
    stray = mdev_backend.create(env.cfg.host, GPU, "nvidia-232")
    problem(env.client.post("/v1/hooks/ensure", json={**body, "uuid": stray.uuid}, headers=h), 409)
    out = env.client.post("/v1/hooks/release", json={"vm": "pve-101"}, headers=h).json()
    assert out == {"vm": "pve-101", "released": [body["uuid"]], "refused": [], "errors": []}
    assert env.client.get("/v1/vgpus", params={"vm": "pve-101"}, headers=h).json() == []


def _domain_xml(name: str, uuid: str, meta: dict | None = None) -> str:
    from vgpumgr.virt import domain

    spec = domain.VmSpec(name, hostdevs=[domain.Hostdev("mdev", uuid=uuid)])
    d = domain.build(spec)
    if meta:
        d.set_allocations([meta])
    from lxml import etree

    return etree.tostring(d.element, encoding="unicode")


def test_libvirt_hook_endpoints(env: ApiEnv) -> None:
    h = env.as_("hook")
    uuid = "8f7c3c52-1d6e-4a3c-9f1e-2b0d7d5a9c10"
    meta = {"uuid": uuid, "backend": "mdev", "parent": GPU, "type": "nvidia-231", "type_name": "GRID T4-2Q"}
    xml = _domain_xml("lv1", uuid, meta)
    r = env.client.post("/v1/hooks/libvirt/prepare", json={"domain": "lv1", "xml": xml}, headers=h)
    assert r.status_code == 200 and r.json()["created"] == [uuid], r.text
    assert env.client.get(f"/v1/vgpus/{uuid}", headers=h).json()["type"] == "nvidia-231"
    r = env.client.post("/v1/hooks/libvirt/prepare", json={"domain": "lv1", "xml": xml}, headers=h)
    assert r.json() == {"vm": "lv1", "ready": [uuid], "created": [], "restored": [], "arrived": []}
    rel = env.client.post("/v1/hooks/libvirt/release", json={"domain": "lv1", "xml": xml}, headers=h).json()
    assert rel["released"] == [uuid]
    unknown = _domain_xml("lv2", "11111111-2222-3333-4444-555555555555")
    body = problem(env.client.post("/v1/hooks/libvirt/prepare", json={"domain": "lv2", "xml": unknown},
                                   headers=h), 404)
    assert "metadata" in body["detail"]
    problem(env.client.post("/v1/hooks/libvirt/prepare", json={"domain": "lv2", "xml": "<domain"}, headers=h), 400)


def test_hook_writes_take_their_turn_with_the_other_vgpu_writes(env: ApiEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hooks that allocate wait for the same turn as POST/DELETE /v1/vgpus (api/writes.py); the VM-release hooks
    do not (each vGPU may wait out a grace period; the host lock per vGPU lets other writes in between)."""
    from api import routes_inventory

    turns: list[str] = []
    real = routes_inventory.one_at_a_time

    async def counted(app, work):  # noqa: ANN001, ANN202
        turns.append("turn")
        return await real(app, work)

    monkeypatch.setattr(routes_inventory, "one_at_a_time", counted)
    h = env.as_("hook")
    body = {"uuid": "00000000-0000-0000-0000-000000000102", "type": "nvidia-232", "vm": "pve-102", "parent": GPU}
    assert env.client.post("/v1/hooks/ensure", json=body, headers=h).status_code == 201
    assert len(turns) == 1
    released = env.client.post("/v1/hooks/release", json={"vm": "pve-102"}, headers=h)  # per vGPU: no turn
    assert released.status_code == 200, released.text
    assert len(turns) == 1 and env.service.allocations(vm="pve-102", live=True) == []
