"""The fleet page over HTTP: hosts x GPUs with their slot maps, stale and cordoned hosts marked, filters and
pages, links to each host's own pages (the browser test takes its screenshot)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fleethosts import board_capacity, publish_synthetic
from test_api import ApiEnv, make_env
from test_ui import login


@pytest.fixture
def env(tmp_path: Path) -> ApiEnv:
    e, client = make_env(tmp_path, "mixed")
    with client:
        yield e


def hosts_shown(html: str) -> dict[str, str]:
    return dict(re.findall(r'<div class="fleet-host \w+" data-host="([^"]+)" data-state="(\w+)"', html))


def test_the_fleet_page_shows_every_host_its_gpus_and_their_slots(env: ApiEnv, tmp_path: Path) -> None:
    url = env.cfg.db_url
    t4 = board_capacity(tmp_path, "t4", scale=2, fill={0: ("T4-4Q", 3)})
    publish_synthetic(url, "gpu-a", t4)
    publish_synthetic(url, "gpu-b", t4, cordon="BIOS update")
    publish_synthetic(url, "gpu-c", t4, stale=True)
    env.service.publish_fleet()
    c = login(env, "auditor")
    page = c.get("/ui/fleet")
    assert page.status_code == 200 and "<script" not in page.text
    me = env.service.hostname
    assert hosts_shown(page.text) == {"gpu-a": "ok", "gpu-b": "cordoned", "gpu-c": "stale", me: "ok"}
    assert "BIOS update" in page.text and re.search(r"last heartbeat 36\d\d s ago \(window 90.0 s\)", page.text)
    # gpu-a's first T4 holds three T4-4Q: three filled boxes and one empty
    block = page.text.split('data-host="gpu-a"')[1].split('class="fleet-host')[0]
    assert 'data-type="T4-4Q" data-used="3" data-free="1"' in block
    assert block.count('class="slot used"') == 3 and block.count('class="slot free"') == 1
    assert 'href="https://gpu-a.example:8470/ui/gpus/0000:3b:00.0"' in block  # its own pages
    mine = page.text.split(f'data-host="{me}"')[1].split('class="fleet-host')[0]
    assert 'href="/ui/"' in mine and 'href="/ui/gpus/0000:65:00.0"' in mine and "mode-mig" in mine
    # one type: only hosts offering it, its boxes marked, and the free instances that can be placed
    page = c.get("/ui/fleet", params={"type": "T4-4Q"})
    assert set(hosts_shown(page.text)) == {"gpu-a", "gpu-b", "gpu-c", me}
    free = int(re.search(r'id="placeable-free"><b>(\d+)</b>', page.text).group(1))
    assert free == 1 + 4 + 4  # gpu-a (1 + 4) and this host's T4 (4); cordoned and stale hosts do not count
    assert "slot free want" in page.text
    assert hosts_shown(c.get("/ui/fleet", params={"type": "L40S-4Q"}).text) == {me: "ok"}
    assert hosts_shown(c.get("/ui/fleet", params={"state": "stale"}).text) == {"gpu-c": "stale"}
    assert c.get("/ui/fleet", params={"state": "bogus"}).status_code == 400
    assert 'id="no-hosts"' in c.get("/ui/fleet", params={"type": "A40-4Q"}).text


def test_a_large_fleet_comes_in_pages(env: ApiEnv, tmp_path: Path) -> None:
    t4 = board_capacity(tmp_path, "t4")
    for i in range(60):
        publish_synthetic(env.cfg.db_url, f"gpu-{i:03d}", t4)
    c = login(env, "auditor")
    first = c.get("/ui/fleet")
    assert len(hosts_shown(first.text)) == 50 and "page 1 of 2 (61 hosts)" in first.text
    second = c.get("/ui/fleet", params={"page": 2})
    assert len(hosts_shown(second.text)) == 11 and 'id="next"' not in second.text
