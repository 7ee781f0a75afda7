"""The web view over HTTP (FastAPI TestClient) on the simulated mixed host: login, roles, CSRF, the slot maps
against `vgpumgr types`/`mig list`, vGPUs created and released from the page, and no 5xx for bad queries."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from simhost import run
from test_api import ApiEnv, make_env

from vgpumgr.audit import chain as audit

T4, L40S, A100 = "0000:3b:00.0", "0000:3d:00.0", "0000:65:00.0"
GPUS = ("0000:00:02.0", T4, L40S, A100)


@pytest.fixture
def env(tmp_path: Path) -> ApiEnv:
    e, client = make_env(tmp_path, "mixed")
    with client:
        yield e


def secret(env: ApiEnv, role: str) -> str:
    return env.headers[role]["Authorization"].split()[1]


def field(html: str, name: str) -> str:
    m = re.search(rf'name="{name}" value="([^"]*)"', html)
    assert m, f"no form field {name}"
    return m.group(1)


def login(env: ApiEnv, role: str, client: TestClient | None = None) -> TestClient:
    c = client or env.client
    page = c.get("/ui/login")
    r = c.post("/ui/login", data={"token": secret(env, role), "csrf": field(page.text, "csrf"), "next": "/ui/"},
               follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/", r.text
    return c


def cli(env: ApiEnv, *argv: str) -> object:
    rc, out, err = run("--sysfs-root", str(env.cfg.host.root), "--state-dir", str(env.cfg.state_dir), *argv)
    assert rc == 0, err
    return json.loads(out)


def page_types(html: str) -> dict[str, int]:
    return {t: int(a) for t, a in re.findall(r'<tr data-type="([^"]+)" data-available="(\d+)"', html)}


def test_pages_need_login_and_login_sets_a_strict_httponly_cookie(env: ApiEnv) -> None:
    r = env.client.get("/ui/gpus/0000:3b:00.0?x=1", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/ui/login?next=%2Fui%2Fgpus%2F0000%3A3b")
    page = env.client.get("/ui/login")
    assert page.status_code == 200 and "Bearer token" in page.text
    bad = env.client.post("/ui/login", data={"token": "vgm_nope", "csrf": field(page.text, "csrf")})
    assert bad.status_code == 401 and "unknown or revoked" in bad.text
    assert "vgpumgr_ui=" not in bad.headers.get("set-cookie", "")
    page = env.client.get("/ui/login")
    ok = env.client.post("/ui/login", data={"token": secret(env, "auditor"), "csrf": field(page.text, "csrf"),
                                            "next": "//evil.example/"}, follow_redirects=False)
    assert ok.status_code == 303 and ok.headers["location"] == "/ui/"  # never off-site
    cookie = next(c for c in ok.headers.get_list("set-cookie") if c.startswith("vgpumgr_ui="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    assert "Secure" not in cookie  # plain http to a non-loopback name: a Secure cookie would be dropped
    home = env.client.get("/ui/")
    assert home.status_code == 200 and "aud1" in home.text and "Content-Security-Policy" in home.headers
    assert "<script" not in home.text


def test_login_needs_the_login_forms_csrf_token_and_loopback_cookie_is_secure(env: ApiEnv) -> None:
    r = env.client.post("/ui/login", data={"token": secret(env, "auditor"), "csrf": "forged"})
    assert r.status_code == 403 and "CSRF" in r.text
    local = TestClient(env.client.app, base_url="http://127.0.0.1:8470")
    page = local.get("/ui/login")
    assert "Secure" in page.headers["set-cookie"]
    nonce = field(page.text, "csrf")  # httpx keeps Secure cookies for https only: send it as a browser would
    r = local.post("/ui/login", data={"token": secret(env, "admin"), "csrf": nonce}, follow_redirects=False,
                   headers={"Cookie": f"vgpumgr_ui_login={nonce}"})
    assert r.status_code == 303 and "Secure" in r.headers["set-cookie"]


def test_hook_tokens_may_not_use_the_web_view(env: ApiEnv) -> None:
    login(env, "hook")
    r = env.client.get("/ui/")
    assert r.status_code == 403 and "role hook" in r.text


def test_slot_maps_match_vgpumgr_types(env: ApiEnv) -> None:
    login(env, "auditor")
    cli_types = cli(env, "types", "--json")
    for gpu in GPUS:
        want: dict[str, int] = defaultdict(int)
        for t in cli_types:
            if t["gpu"] == gpu or t["parent"] == gpu:
                want[t["type"]] += t["available_instances"]
        html = env.client.get(f"/ui/gpus/{gpu}").text
        assert page_types(html) == dict(want), gpu
    a100 = env.client.get(f"/ui/gpus/{A100}").text
    # MIG is on and there is no GPU instance yet: MIG-backed types say which instance they need
    assert re.search(r'data-type="nvidia-701".*?no free 3g.40gb GPU instance', a100, re.S)
    assert re.search(r'data-type="nvidia-697".*?time-sliced A100D-40C needs MIG off', a100, re.S)
    assert len(re.findall(r'<tr id="vf-', env.client.get(f"/ui/gpus/{L40S}").text)) == 8


def test_equal_mode_l40s_shows_its_homogeneous_placement_map(env: ApiEnv) -> None:
    login(env, "auditor")
    assert 'id="placement-map"' not in env.client.get(f"/ui/gpus/{T4}").text  # Turing: no placement IDs
    env.service.allocate("L40S-8Q", vm="a")
    html = env.client.get(f"/ui/gpus/{L40S}").text
    assert "Placement map (equal-size mode, homogeneous placement IDs)" in html
    assert len(re.findall(r'class="gb held', html)) == 8 and "<li>0–7: L40S-8Q of a</li>" in html
    rows = dict(re.findall(r"<tr><td>NVIDIA (L40S-\d+Q)</td><td>\d+ GB</td><td>([^<]*)</td>", html))
    assert rows["L40S-8Q"] == "8, 16, 24, 32, 40" and rows["L40S-12Q"] == "none"


def test_mig_slices_match_vgpumgr_mig_list(env: ApiEnv) -> None:
    login(env, "auditor")
    cli(env, "mig", "create", A100, "3g.40gb")
    cli(env, "mig", "create", A100, "1g.10gb")
    env.service.invalidate()
    gis = cli(env, "mig", "list", "--json")[A100]["gpu_instances"]
    assert len(gis) == 2
    html = env.client.get(f"/ui/gpus/{A100}").text
    shown = re.findall(r'data-gi="(\d+)" data-profile="([^"]+)"\s+data-start="(\d+)" data-size="(\d+)"', html)
    assert sorted(shown) == sorted((str(g["id"]), g["profile"], str(g["start"]), str(g["size"])) for g in gis)
    # 1g.10gb holds slice 0; 4g.40gb (start 0 only) has no room and the page says why, in the words `mig create`
    # and placement use (mig.plan.no_room)
    assert re.search(r'data-profile="4g.40gb" data-free="">.*?no room for a 4g.40gb instance \(slices [\d, -]+ '
                     r'taken by 1g.10gb \(GI \d+\)\)', html, re.S)
    used = {s for g in gis for s in range(g["start"], g["start"] + g["size"])}
    assert f"free slices: {', '.join(str(s) for s in range(8) if s not in used)}." in html


def test_operator_creates_and_releases_a_vgpu_from_the_page_audited_with_the_token(env: ApiEnv) -> None:
    login(env, "operator")
    gpu_page = env.client.get(f"/ui/gpus/{T4}").text
    assert 'id="create-vgpu"' in gpu_page and '<option value="nvidia-232">' in gpu_page
    r = env.client.post("/ui/vgpus", data={"csrf": field(gpu_page, "csrf"), "gpu": T4, "type": "nvidia-232",
                                           "vm": "web1"})
    assert r.status_code == 200 and "created GRID T4-4Q" in r.text
    live = env.service.allocations(live=True)
    assert [(a["type"], a["vm"], a["gpu"]) for a in live] == [("nvidia-232", "web1", T4)]
    uuid = live[0]["uuid"]
    assert f'data-ref="{uuid}"' in r.text
    cli_avail = sum(t["available_instances"] for t in cli(env, "types", "--json") if t["type"] == "nvidia-232")
    assert page_types(r.text)["nvidia-232"] == cli_avail == 3
    r = env.client.post(f"/ui/vgpus/{uuid}/release", data={"csrf": field(r.text, "csrf"),
                                                            "back": f"/ui/gpus/{T4}"})
    assert r.status_code == 200 and f"released {uuid}" in r.text and page_types(r.text)["nvidia-232"] == 4
    assert env.service.allocations(live=True) == []
    with env.service.sessions() as s:
        events = [(e.action, e.actor, e.vgpu) for e in audit.query(s, vgpu=uuid)]
    assert {a for a, actor, _ in events if actor == "token:ope1"} >= {"vgpu.create", "vgpu.remove"}, events
    trail = env.client.get("/ui/audit", params={"actor": "token:ope1"}).text
    assert "Hash chain verified" in trail and 'data-action="vgpu.create"' in trail


def test_a_failed_create_shows_why_and_changes_nothing(env: ApiEnv) -> None:
    login(env, "operator")
    csrf = field(env.client.get(f"/ui/gpus/{T4}").text, "csrf")
    r = env.client.post("/ui/vgpus", data={"csrf": csrf, "gpu": T4, "type": "nvidia-697"})
    assert r.status_code == 409 and 'id="error"' in r.text
    r = env.client.post("/ui/vgpus", data={"csrf": csrf, "gpu": T4, "type": "nvidia-232", "vm": "bad name!"})
    assert r.status_code == 400
    assert env.service.allocations(live=True) == []


def test_auditor_reads_everything_and_may_change_nothing(env: ApiEnv) -> None:
    made = env.service.allocate("T4-4Q", vm="db1", actor="test")
    login(env, "auditor")
    for path in ("/ui/", f"/ui/gpus/{T4}", "/ui/vms", "/ui/placements", "/ui/licences", "/ui/audit",
                 "/ui/reconcile", "/ui/audit/export?format=csv"):
        assert env.client.get(path).status_code == 200, path
    page = env.client.get(f"/ui/gpus/{T4}").text
    assert 'id="create-vgpu"' not in page and "data-release" not in page
    csrf = field(page, "csrf")  # the logout form's: valid, but the role may not change anything
    r = env.client.post("/ui/vgpus", data={"csrf": csrf, "gpu": T4, "type": "nvidia-232"})
    assert r.status_code == 403 and "may only read" in r.text
    r = env.client.post(f"/ui/vgpus/{made['uuid']}/release", data={"csrf": csrf})
    assert r.status_code == 403
    assert [a["uuid"] for a in env.service.allocations(live=True)] == [made["uuid"]]


def test_every_change_needs_the_sessions_csrf_token(env: ApiEnv) -> None:
    login(env, "operator")
    good = field(env.client.get("/ui/").text, "csrf")
    for data, headers in (({}, {}), ({"csrf": "0" * 64}, {}), ({"csrf": good}, {"Origin": "https://evil.example"})):
        r = env.client.post("/ui/vgpus", data={**data, "gpu": T4, "type": "nvidia-232"}, headers=headers)
        assert r.status_code == 403 and "CSRF" in r.text or "another site" in r.text, r.text
    assert env.client.post("/ui/logout", data={}).status_code == 403
    other = TestClient(env.client.app)
    login(env, "admin", other)  # another token's CSRF value is no good for this one
    theirs = field(other.get("/ui/").text, "csrf")
    assert theirs != good
    assert env.client.post("/ui/vgpus", data={"csrf": theirs, "gpu": T4, "type": "nvidia-232"}).status_code == 403
    assert env.service.allocations(live=True) == []
    r = env.client.post("/ui/logout", data={"csrf": good}, follow_redirects=False)
    assert r.status_code == 303 and 'vgpumgr_ui=""' in r.headers["set-cookie"]


def test_placements_and_audit_filters(env: ApiEnv) -> None:
    a = env.service.allocate("T4-4Q", vm="web1", actor="test")
    env.service.allocate("T4-4Q", vm="web2", actor="test")
    login(env, "auditor")
    r = env.client.get("/ui/placements?vm=web1&gpu=&type=&state=").text  # as the filter form sends it
    assert re.findall(r'<tr data-ref="([^"]+)"', r) == [a["uuid"]]
    assert len(re.findall(r"<tr data-ref=", env.client.get("/ui/placements?type=T4-4Q").text)) == 2
    assert 'id="no-rows"' in env.client.get("/ui/placements?gpu=0000:65:00.0").text
    trail = env.client.get("/ui/audit?vm=web2&gpu=&vgpu=&actor=&action=vgpu.create&outcome=&since=&until=&limit=200"
                           ).text  # as the filter form sends it
    assert re.findall(r'data-action="([^"]+)"', trail) == ["vgpu.create"]
    csv = env.client.get("/ui/audit/export", params={"format": "csv", "vm": "web2"})
    assert csv.headers["content-type"].startswith("text/csv") and "attachment" in csv.headers["content-disposition"]
    rows = csv.text.strip().splitlines()
    assert rows[0].startswith("seq,at,host,actor") and all(",web2," in row for row in rows[1:]) and len(rows) > 1
    js = env.client.get("/ui/audit/export", params={"format": "json", "vm": "web1"}).json()
    assert js and {e["vm"] for e in js} == {"web1"}


def test_bad_query_strings_get_a_4xx_page_never_a_5xx(env: ApiEnv) -> None:
    login(env, "operator")
    junk = ["", "?limit=0", "?limit=abc", "?since=yesterday", "?since=2025-02-01&until=2025-01-01",
            "?outcome=maybe", "?state=gone", "?vm=%00", "?vm=" + "x" * 300, "?gpu=zz:zz", "?gpu=%ff%fe",
            "?format=xml", "?next=%0d%0a", "?vm=a&vm=b&vm=c", "?type=%", "?vgpu=../../etc"]
    for path in ("/ui/", f"/ui/gpus/{T4}", "/ui/gpus/zz", "/ui/gpus/0000:99:00.0", "/ui/gpus/0000:3d:00.4",
                 "/ui/vms", "/ui/placements", "/ui/licences", "/ui/audit", "/ui/audit/export", "/ui/reconcile",
                 "/ui/login"):
        for q in junk:
            r = env.client.get(path + q, follow_redirects=False)
            assert r.status_code < 500, (path + q, r.status_code, r.text[:300])
    assert env.client.get("/ui/gpus/0000:99:00.0").status_code == 404
    assert env.client.get("/ui/audit?since=yesterday").status_code == 400
    r = env.client.get("/ui/gpus/0000:3d:00.4", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith(f"/ui/gpus/{L40S}")
    for data in ({"gpu": "nonsense", "type": "x"}, {"gpu": T4, "type": ""}, {"gpu": T4, "type": "x" * 500}):
        csrf = field(env.client.get("/ui/").text, "csrf")
        assert 400 <= env.client.post("/ui/vgpus", data={**data, "csrf": csrf}).status_code < 500
    csrf = field(env.client.get("/ui/").text, "csrf")
    assert env.client.post("/ui/vgpus/not-a-uuid/release", data={"csrf": csrf}).status_code == 400
