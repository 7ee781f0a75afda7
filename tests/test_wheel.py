"""The built wheel, installed (not editable) into a fresh venv, runs `demo`, `db upgrade` and `serve` from a
directory far from the source tree, with the source tree nowhere on sys.path.

No network: the wheel is built without build isolation and installed with --no-deps; the new venv reaches
the already-installed dependencies through a .pth line naming the dev venv's site-packages (a path line in
a .pth does not run that directory's own .pth files, so the dev venv's editable install stays out).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import wheels

REPO = wheels.REPO



@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv with only the wheel in it; yields its bin/ directory."""
    base = tmp_path_factory.mktemp("wheel")
    src = wheels.copy_sources(base / "src")  # a copy: building leaves no build/ or egg-info in the checkout
    wheel = wheels.build_wheel(src, base / "dist")
    bin_dir = wheels.install(wheel, base / "venv")
    shutil.rmtree(src)  # nothing of the source tree is left next to the install either
    yield bin_dir


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VGPUMGR_", "PYTHON"))}
    env.update(VGPUMGR_STATE_DIR=str(tmp / "state"), HOME=str(tmp), PYTHONDONTWRITEBYTECODE="1")
    return env


def _run(bin_dir: Path, tmp: Path, *argv: str, timeout: float = 60) -> str:
    p = subprocess.run([str(bin_dir / "vgpumgr"), *argv], cwd=tmp, env=_env(tmp), capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"vgpumgr {' '.join(argv)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_imports_come_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    code = ("import json, sys, vgpumgr, api, vgpumgr.virt.domain, vgpumgr.db.session as s; "
            "print(json.dumps({'path': sys.path, 'vgpumgr': list(vgpumgr.__path__), 'api': api.__file__, "
            "'migrations': str(s.MIGRATIONS_DIR), 'templates': str(vgpumgr.virt.domain.data_dir('xml_templates'))}))")
    p = subprocess.run([str(installed / "python"), "-c", code], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=60, check=True)
    found = json.loads(p.stdout)
    venv = str(installed.parent)
    assert str(REPO) not in found["path"], found["path"]  # "" is the cwd, a temporary directory
    for key in ("vgpumgr", "api", "migrations", "templates"):
        value = found[key][0] if isinstance(found[key], list) else found[key]
        assert value.startswith(venv), f"{key} resolved to {value}, outside the wheel's venv"
    assert not Path(found["migrations"]).is_symlink() and (Path(found["migrations"]) / "env.py").is_file()
    assert (Path(found["migrations"]) / "sqlite-head.sql").is_file()  # a new SQLite database's schema


def test_demo_and_db_upgrade(installed: Path, tmp_path: Path) -> None:
    out = _run(installed, tmp_path, "demo")
    assert "vgpumgr vm create" in out
    db = f"sqlite:///{tmp_path / 'fresh.db'}"
    out = _run(installed, tmp_path, "--db", db, "db", "upgrade")
    newest = sorted((REPO / "migrations/versions").glob("*.py"))[-1].stem
    assert f"applied {newest} (expand)" in out and out.endswith(f"database at revision {newest}\n"), out
    assert _run(installed, tmp_path, "--db", db, "db", "current").strip() == newest


def test_serve_on_a_unix_socket(installed: Path, tmp_path: Path) -> None:
    root = tmp_path / "host"
    _run(installed, tmp_path, "sim", "create", str(root), "--profile", "t4")
    sock = tmp_path / "run" / "api.sock"
    env = _env(tmp_path)
    env["VGPUMGR_LIBVIRT_URI"] = "test:///default"
    server = subprocess.Popen([str(installed / "vgpumgr"), "--sysfs-root", str(root), "serve", "--socket", str(sock),
                               "--log-level", "warning"], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not sock.is_socket():
            assert server.poll() is None, f"serve exited {server.returncode}: {server.stderr.read()}"
            assert time.monotonic() < deadline, "the socket did not appear in 30 s"
            time.sleep(0.1)
        assert sock.stat().st_mode & 0o777 == 0o660
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://vgpumgr") as client:
            r = client.get("/v1/health")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "ok" and r.json()["simulated"] is True and r.json()["gpus"] >= 1
    finally:
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=15)
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught (systemd counts that as success)
    assert server.returncode in (0, -signal.SIGTERM) and "Traceback" not in err, err


def test_install_units_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    dest = tmp_path / "units"
    dest.mkdir()
    written = json.loads(_run(installed, tmp_path, "install-units", "--dest", str(dest), "--json"))
    assert written["executable"] == str(installed / "vgpumgr")  # found without --bin: the running entry point
    assert sorted(Path(p).name for p in written["units"]) == ["vgpumgr-restore.service", "vgpumgr.service",
                                                              "vgpumgr.socket"]
    assert f"ExecStart={installed / 'vgpumgr'} restore" in (dest / "vgpumgr-restore.service").read_text()
