"""The web view in a real headless Chromium (Debian's package, driven by Playwright for Python) against
`python -m api.server` (what `vgpumgr serve` runs) on 127.0.0.1 and the simulated mixed host.

Screenshots of each page go to docs/screenshots/ (or $VGPUMGR_SCREENSHOTS)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from simhost import run

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("Debian's chromium is not installed (scripts/setup installs it: apt-get install chromium)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright pip package is missing (scripts/setup)")

from api import tokens  # noqa: E402
from vgpumgr.config import Config  # noqa: E402
from vgpumgr.sim import profiles  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHOTS = Path(os.environ.get("VGPUMGR_SCREENSHOTS", REPO / "docs" / "screenshots"))
T4, A100 = "0000:3b:00.0", "0000:65:00.0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path) -> None:
        self.root = profiles.create(tmp / "sim", "mixed")
        testhost = tmp / "testhost.xml"
        testhost.write_text("<node><cpu><mode>host-passthrough</mode></cpu></node>\n")
        self.args = ["--sysfs-root", str(self.root), "--state-dir", str(tmp / "state"), "--connect",
                     f"test://{testhost}"]
        self.cfg = Config.resolve(sysfs_root=str(self.root), state_dir=str(tmp / "state"),
                                  connect=f"test://{testhost}")
        self.secrets = {role: tokens.create_token(self.cfg, f"{role}-web", role) for role in ("operator", "auditor")}
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (tmp / "server.log").open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "api.server", "--host", "127.0.0.1", "--port",
                                      str(self.port), *self.args], cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(self.url + "/v1/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the service did not start: {(tmp / 'server.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def cli_json(self, *argv: str) -> object:
        rc, out, err = run(*self.args[:4], *argv)
        assert rc == 0, err
        return json.loads(out)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("ui-browser"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def shot(page: object, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def log_in(browser: object, server: Server, role: str) -> object:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.goto(server.url + "/ui/")
    assert page.url.startswith(server.url + "/ui/login?next=")
    page.fill("#token", server.secrets[role])
    page.click("#login")
    page.wait_for_url(server.url + "/ui/")
    return page


def types_shown(page: object) -> dict[str, int]:
    return {r.get_attribute("data-type"): int(r.get_attribute("data-available"))
            for r in page.locator("#types tbody tr").all()}


def cli_available(server: Server, gpu: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in server.cli_json("types", "--json"):
        if t["gpu"] == gpu or t["parent"] == gpu:
            out[t["type"]] = out.get(t["type"], 0) + t["available_instances"]
    return out


def test_operator_clicks_through_login_slot_maps_create_release_and_audit(browser: object, server: Server) -> None:
    page = browser.new_context().new_page()
    page.goto(server.url + "/ui/")
    shot(page, "login")
    page.fill("#token", "vgm_wrong")
    page.click("#login")
    assert "unknown or revoked" in page.inner_text("#error")
    page.context.close()

    page = log_in(browser, server, "operator")
    cookie = next(c for c in page.context.cookies() if c["name"] == "vgpumgr_ui")
    # Chromium keeps a Secure cookie for http://127.0.0.1 (a loopback origin counts as secure)
    assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
    assert page.evaluate("document.cookie") == ""  # HttpOnly: scripts never see the token
    rows = page.locator("#gpus tbody tr")
    assert rows.count() == 4 and "operator-web" in page.inner_text("#who")
    assert "intact" in page.inner_text("#chain-summary")
    shot(page, "overview")

    page.click(f'a[href="/ui/gpus/{A100}"]')
    assert page.inner_text("#mig-mode") == "enabled"
    assert types_shown(page) == cli_available(server, A100)
    assert "no free 3g.40gb GPU instance" in page.inner_text('tr[data-type="nvidia-701"]')
    shot(page, "gpu-a100-mig")

    page.click("text=Host")
    page.click(f'a[href="/ui/gpus/{T4}"]')
    assert types_shown(page) == cli_available(server, T4)
    page.select_option("#create-type", "nvidia-232")
    page.fill("#create-vm", "web1")
    page.click("#create")
    assert "created GRID T4-4Q" in page.inner_text("#notice")
    assert page.locator("#instances tbody tr").count() == 1
    ref = page.locator("#instances tbody tr").first.get_attribute("data-ref")
    assert "web1" in page.inner_text(f'tr[data-ref="{ref}"]')
    assert types_shown(page) == cli_available(server, T4) and types_shown(page)["nvidia-232"] == 3
    shot(page, "gpu-t4-slot-map")

    page.click("text=Placements")
    page.fill('input[name="vm"]', "web1")
    page.click("text=Filter")
    assert page.locator("#placements tbody tr[data-ref]").count() == 1
    shot(page, "placements")
    for name in ("VMs", "Licences", "Reconcile"):
        page.click(f"header >> text={name}")
        assert page.locator("h1").count() == 1
        shot(page, name.lower())

    page.click("text=Host")
    page.click(f'a[href="/ui/gpus/{T4}"]')
    page.click(f'button[data-release="{ref}"]')
    assert f"released {ref}" in page.inner_text("#notice")
    assert page.locator("#no-instances").count() == 1 and types_shown(page)["nvidia-232"] == 4

    page.click("header >> text=Audit")
    assert "Hash chain verified" in page.inner_text("#chain")
    page.fill('input[name="actor"]', "token:operator-web")
    page.click("text=Filter")
    actions = set(page.locator("#events tbody tr").evaluate_all("rows => rows.map(r => r.dataset.action)"))
    assert {"vgpu.create", "vgpu.remove"} <= actions
    shot(page, "audit")
    with page.expect_download() as dl:
        page.click("#export-csv")
    csv = Path(dl.value.path()).read_text()
    assert csv.startswith("seq,at,host,actor") and "token:operator-web" in csv
    page.click("#who + input + button")  # log out
    assert "/ui/login" in page.url
    page.context.close()


def test_an_auditor_in_the_browser_sees_no_forms_and_gets_403_on_changes(browser: object, server: Server) -> None:
    page = log_in(browser, server, "auditor")
    page.click(f'a[href="/ui/gpus/{T4}"]')
    assert page.locator("#create-vgpu").count() == 0 and page.locator("button[data-release]").count() == 0
    csrf = page.locator('input[name="csrf"]').first.get_attribute("value")
    r = page.request.post(server.url + "/ui/vgpus", form={"csrf": csrf, "gpu": T4, "type": "nvidia-232"},
                          max_redirects=0)
    assert r.status == 403 and re.search("may only read", r.text())
    assert server.cli_json("placements", "--json") == []
    page.context.close()


def test_telemetry_charts_and_the_licence_check_in_the_browser(browser: object, tmp_path: Path) -> None:
    """Per-VM and per-GPU utilisation charts drawn by the server (SVG, no JavaScript) from samples taken every
    0.3 s here, and the licence page's guests-against-ledger section."""
    from vgpumgr.sim import guests

    os.environ["VGPUMGR_TELEMETRY_INTERVAL"] = "0.3"
    try:
        server = Server(tmp_path)
    finally:
        del os.environ["VGPUMGR_TELEMETRY_INTERVAL"]
    try:
        for vm, vgpu, load, lic in (("render1", "L40S-4Q", {"sm": 55, "mem": 30, "enc": 20, "wobble": 25}, "licensed"),
                                    ("train1", "L40S-4Q", {"sm": 85, "mem": 70, "wobble": 10}, "unlicensed"),
                                    ("idle1", "T4-2Q", {"sm": 5, "wobble": 4}, "uninitialized")):
            made = server.cli_json("vm", "create", vm, "--vgpu", vgpu, "--start", "--json")
            a = made["allocations"][0]
            ref = a["uuid"] or a["pci_address"]
            guests.start(server.root, ref, vm_uuid=made["uuid"], vm_name=vm)  # already its guest: vm create --start
            guests.set_load(server.root, ref, fb_used_mb=2048, **load)
            guests.set_licence(server.root, ref, lic)
        time.sleep(3)  # ten samples or so
        page = log_in(browser, server, "auditor")
        page.click("header >> text=Telemetry")
        rows = page.locator("#vgpus tbody tr[data-vm]")
        assert [r.get_attribute("data-vm") for r in rows.all()] == ["train1", "render1", "idle1"]  # busiest first
        charts = page.locator("figure.vgpu-chart")
        assert sorted(c.get_attribute("data-vm") for c in charts.all()) == ["idle1", "render1", "train1"]
        sm_line = page.locator('figure.vgpu-chart[data-vm="render1"] polyline[data-engine="sm"]')
        assert len(sm_line.get_attribute("points").split()) >= 5  # a line over several samples
        assert page.locator("figure.gpu-chart").count() >= 1
        assert page.evaluate("document.scripts.length") == 0
        shot(page, "telemetry")
        page.click("header >> text=Licences")
        findings = {(r.get_attribute("data-kind"), r.get_attribute("data-vm"))
                    for r in page.locator("#licence-findings tbody tr").all()}
        assert ("licensed-without-seat", "render1") in findings  # no pools: nobody holds a seat
        shot(page, "licences-check")
        page.context.close()
    finally:
        server.stop()
def test_the_fleet_page_reads_at_a_glance(browser: object, server: Server, tmp_path: Path) -> None:
    """Hosts x GPUs: the served host and others that exist as the rows vgpumgr's publishing code wrote (one
    cordoned, one stale), each GPU a slot map of the types in use; screenshot for the README."""
    from fleethosts import board_capacity, publish_synthetic

    url = server.cfg.db_url
    publish_synthetic(url, "gpu-node-01", board_capacity(tmp_path, "t4", scale=4, fill={0: ("T4-4Q", 3),
                                                                                         1: ("T4-8Q", 2),
                                                                                         2: ("T4-16Q", 1)}))
    publish_synthetic(url, "gpu-node-02", board_capacity(tmp_path, "l40s-vfio", scale=4, vfs=8,
                                                         fill={0: ("L40S-4Q", 5), 1: ("L40S-12Q", 2),
                                                               3: ("L40S-48Q", 1)}))
    publish_synthetic(url, "gpu-node-03", board_capacity(tmp_path, "a100-mig", scale=2, vfs=8),
                      cordon="BIOS update, drained by ops")
    publish_synthetic(url, "gpu-node-04", board_capacity(tmp_path, "t4", scale=4, fill={0: ("T4-2Q", 6)}),
                      stale=True)
    page = log_in(browser, server, "auditor")
    page.click("header >> text=Fleet")
    page.wait_for_url(server.url + "/ui/fleet")
    states = {h.get_attribute("data-host"): h.get_attribute("data-state")
              for h in page.locator(".fleet-host").all()}
    me = server.cli_json("fleet", "hosts", "--json")
    assert {h["host"] for h in me} == set(states)
    assert states["gpu-node-03"] == "cordoned" and states["gpu-node-04"] == "stale" and states["gpu-node-01"] == "ok"
    node1 = page.locator('.fleet-host[data-host="gpu-node-01"] .fleet-gpu').first
    assert node1.locator(".slot.used").count() == 3 and node1.locator(".slot.free").count() == 1
    assert "BIOS update" in page.inner_text('.fleet-host[data-host="gpu-node-03"]')
    assert "last heartbeat" in page.inner_text('.fleet-host[data-host="gpu-node-04"]')
    shot(page, "fleet")
    page.fill('input[name="type"]', "L40S-4Q")
    page.click("text=Show")
    served = next(h["host"] for h in me if not h["host"].startswith("gpu-node-"))
    assert sorted(h.get_attribute("data-host") for h in page.locator(".fleet-host").all()) == sorted(
        ["gpu-node-02", served])  # only the hosts that offer it
    assert page.locator(".slot.want").count() > 0
    page.context.close()
