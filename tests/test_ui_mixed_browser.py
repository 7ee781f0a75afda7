"""The web view's placement map of a GPU in mixed-size mode, in a real headless Chromium against
`python -m api.server` on a simulated L40S: the fragmented GPU of README "Mixed-size mode" (its screenshot:
docs/screenshots/gpu-placement-map.png)."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_ui_browser as ui  # skips the module where chromium or playwright is missing
from simhost import run

L40S = "0000:3d:00.0"


class MixedServer(ui.Server):
    """test_ui_browser's server, on the l40s-vfio profile."""

    def __init__(self, tmp: Path) -> None:
        create = ui.profiles.create
        ui.profiles.create = lambda root, _profile, **kw: create(root, "l40s-vfio", vfs=8)  # type: ignore[assignment]
        try:
            super().__init__(tmp)
        finally:
            ui.profiles.create = create  # type: ignore[assignment]


def test_placement_map_shows_the_fragmentation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPUMGR_LICENCE_MODE", "off")
    server = MixedServer(tmp_path)
    try:
        def cli(*argv: str) -> None:
            rc, _, err = run(*server.args, *argv)
            assert rc == 0, err

        cli("gpu", "mode", L40S, "--mixed")
        for vm, t, at in (("vm7", "L40S-2Q", "0"), ("vm9", "L40S-2Q", "24"), ("vm8", "L40S-16Q", "32"),
                          ("vm6", "L40S-4Q", "12")):
            cli("vm", "create", vm, "--vgpu", t, "--placement-id", at)
        with ui.sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=ui.CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = ui.log_in(browser, server, "auditor")
            page.goto(f"{server.url}/ui/gpus/{L40S}")
            cells = page.locator("#placement-map .gb").all()
            assert len(cells) == 48
            held = [c.get_attribute("title") for c in cells]
            assert held[0] == "0: L40S-2Q of vm7" and held[24] == "24: L40S-2Q of vm9" and held[2] == "2: free"
            assert "32: L40S-16Q of vm8" == held[32] and "47: L40S-16Q of vm8" == held[47]
            rows = {r.locator("td").nth(0).inner_text(): r.locator("td").nth(2).inner_text()
                    for r in page.locator("#placements-by-type tbody tr").all()}
            assert rows["NVIDIA L40S-24Q"] == "none" and rows["NVIDIA L40S-12Q"] == "none"
            assert rows["NVIDIA L40S-8Q"] == "16"
            page.locator("#placement-map").scroll_into_view_if_needed()
            ui.SHOTS.mkdir(parents=True, exist_ok=True)
            page.locator("#placement").screenshot(path=str(ui.SHOTS / "gpu-placement-map.png"))
            browser.close()
    finally:
        server.stop()
