"""What a GPU in NVIDIA's mixed-size mode can take, counted once: the web view's slot map, `types --json`,
GET /v1/types and /metrics all give, for every type, the number `fleet capacity --type` gives (vGPUs of that
type made one after the other by the placement rules), not the free VFs that each list the type (issue 44)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from simhost import run
from test_api import ApiEnv, make_env
from test_telemetry import of, scrape
from test_ui import login

from vgpumgr.placement.placer import Policy

L40S = "0000:3d:00.0"
ISSUE = [("L40S-4Q", None), ("L40S-8Q", None), ("L40S-2Q", None), ("L40S-12Q", None)]
STATES = {
    "issue": ISSUE,
    "holes": [("L40S-2Q", 0), ("L40S-2Q", 24)],
    "scattered": [("L40S-2Q", 0), ("L40S-2Q", 24), ("L40S-1Q", 47), ("L40S-6Q", 12), ("L40S-3Q", 33)],
}


def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vgpus: list[tuple[str, int | None]]) -> ApiEnv:
    monkeypatch.setenv("VGPUMGR_LICENCE_MODE", "off")
    env, client = make_env(tmp_path, "l40s-vfio")
    r = client.put(f"/v1/gpus/{L40S}/vgpu-mode", json={"mode": "mixed"}, headers=env.headers["admin"])
    assert r.status_code == 200, r.text
    for n, (type_name, at) in enumerate(vgpus):
        env.service.allocate(type_name, vm=f"vm{n}", policy=Policy(placement_id=at))
    env.service.invalidate()
    return env


def cli(env: ApiEnv, *argv: str) -> str:
    rc, out, err = run("--sysfs-root", str(env.cfg.host.root), "--state-dir", str(env.cfg.state_dir), *argv)
    assert rc == 0, err
    return out


def page_rows(html: str) -> dict[str, tuple[int, int, str]]:
    """Type name -> (available, free boxes drawn, why none is creatable) of the GPU page's slot map."""
    rows = re.findall(r'<tr data-type="[^"]+" data-available="(\d+)".*?<td>([^<]*)</td>.*?<td class="slots">(.*?)'
                      r'</td>\s*<td class="reason">([^<]*)</td>', html, re.S)
    return {name.split()[-1]: (int(a), slots.count('"slot free"'), why) for a, name, slots, why in rows}


def by_type(rows: list[dict], key: str = "gpu_available") -> dict[str, int]:
    """Type name -> its GPU's count, the same on every row of the type."""
    seen: dict[str, set[int]] = {}
    for r in rows:
        if r.get("gpu") == L40S:
            seen.setdefault(r["name"].split()[-1], set()).add(r[key])
    assert all(len(v) == 1 for v in seen.values()), seen
    return {k: v.pop() for k, v in seen.items()}


@pytest.mark.parametrize("state", sorted(STATES))
def test_every_count_equals_fleet_capacity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: str) -> None:
    env = _env(tmp_path, monkeypatch, STATES[state])
    cli(env, "fleet", "publish")
    page = page_rows(login(env, "auditor").get(f"/ui/gpus/{L40S}").text)
    types_cli = by_type(json.loads(cli(env, "types", "--json")))
    rest = by_type(env.client.get("/v1/types", headers=env.headers["auditor"]).json())
    metrics = {dict(k)["type"]: int(v) for k, v in of(scrape(env.service), "vgpumgr_gpu_free_slots", gpu=L40S).items()}
    assert len(page) == 23 and set(metrics) == set(page)  # every type of the L40S, listed by a VF or not
    for short, (available, boxes, why) in page.items():
        cap = json.loads(cli(env, "fleet", "capacity", "--type", short, "--json"))["hosts"][0]["free"]
        got = (available, boxes, types_cli.get(short, 0), rest.get(short, 0), metrics[short])
        assert got == (cap,) * 5, (state, short, got)
        assert bool(why) == (cap == 0), (short, why)


def test_the_issues_gpu_page_says_what_can_be_made_and_why_not(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(tmp_path, monkeypatch, ISSUE)
    html = login(env, "auditor").get(f"/ui/gpus/{L40S}").text
    page = page_rows(html)
    assert {t: page[t][:2] for t in ("L40S-12Q", "L40S-4Q", "L40S-1Q", "L40S-16Q", "L40S-24Q")} == {
        "L40S-12Q": (1, 1), "L40S-4Q": (4, 4), "L40S-1Q": (7, 7), "L40S-16Q": (0, 0), "L40S-24Q": (0, 0)}
    assert "22 GB free on 0000:3d:00.0 but no 16Q start free (0: L40S-8Q of vm1, 32: L40S-12Q of vm3)" \
        in page["L40S-16Q"][2]
    assert "26 of 48 GB in use, L40S-24Q needs 24 GB" in page["L40S-24Q"][2]
    assert "one after the other" in html and " on 28 parents" not in html
    # the per-VF listing stays the driver's: every free VF lists the 12Q
    assert html.count("Types the driver lists as creatable on this VF") == 1
    text = cli(env, "types")
    assert "AVAIL above is per VF" in text
    assert re.search(r"0000:3d:00.0\s+nvidia-\d+\s+NVIDIA L40S-12Q\s+1\n", text)
    rows = json.loads(cli(env, "types", "--json"))
    twelve = [r for r in rows if r["name"] == "NVIDIA L40S-12Q"]
    assert len(twelve) == 28 and {(r["available_instances"], r["gpu_available"]) for r in twelve} == {(1, 1)}
