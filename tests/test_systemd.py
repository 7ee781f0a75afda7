"""systemd units: `vgpumgr install-units` renders them for this installation, `systemd-analyze verify` accepts
them, the restore unit is ordered before the guests, and `serve` takes a socket-activated fd (LISTEN_FDS)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from simhost import make, run

from api.server import DEFAULT_SOCKET, systemd_socket
from vgpumgr.errors import InvalidInput
from vgpumgr.platforms.systemd_units import UNITS

VGPUMGR = Path(sys.executable).with_name("vgpumgr")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (systemd allows a key many times; space-separated lists are split)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).extend(value.split() if key in ("After", "Before", "WantedBy") else [value])
    return sections


@pytest.fixture
def units(tmp_path: Path) -> dict[str, Path]:
    rc, out, err = run("install-units", "--dest", str(tmp_path), "--bin", str(VGPUMGR), "--json")
    assert rc == 0, err
    written = json.loads(out)
    assert written["executable"] == str(VGPUMGR)
    return {Path(p).name: Path(p) for p in written["units"]}


def test_install_units_writes_every_unit_with_this_executable(units: dict[str, Path]) -> None:
    assert sorted(units) == sorted(UNITS)
    for path in units.values():
        text = path.read_text()
        assert "/usr/local/bin/vgpumgr" not in text
        for line in text.splitlines():
            if line.startswith(("ExecStart=", "ExecStartPre=")):
                assert line.split("=", 1)[1].split()[0] == str(VGPUMGR), line
        assert path.stat().st_mode & 0o777 == 0o644


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_passes(units: dict[str, Path]) -> None:
    p = subprocess.run(["systemd-analyze", "verify", "--man=no", *(str(units[u]) for u in UNITS)],
                       capture_output=True, text=True, timeout=60, cwd=units[UNITS[0]].parent)
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip() == "", f"systemd-analyze warned:\n{p.stderr}"  # unknown keys only warn


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_rejects_a_missing_executable(tmp_path: Path, units: dict[str, Path]) -> None:
    bad = tmp_path / "bad" / "vgpumgr-restore.service"
    bad.parent.mkdir()
    bad.write_text(units["vgpumgr-restore.service"].read_text().replace(str(VGPUMGR), str(tmp_path / "nope")))
    p = subprocess.run(["systemd-analyze", "verify", "--man=no", str(bad)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0 and "nope" in p.stderr  # so the passing verify above means something


def test_restore_runs_once_after_the_driver_and_before_the_guests(units: dict[str, Path]) -> None:
    u = parse_unit(units["vgpumgr-restore.service"].read_text())
    svc = u["Service"]
    assert svc["Type"] == ["oneshot"] and svc["RemainAfterExit"] == ["yes"]
    assert svc["ExecStart"] == [f"{VGPUMGR} restore"]
    after, before = set(u["Unit"]["After"]), set(u["Unit"]["Before"])
    assert {"systemd-modules-load.service", "nvidia-vgpu-mgr.service", "nvidia-persistenced.service"} <= after
    assert {"libvirt-guests.service", "pve-guests.service", "libvirtd.service", "nova-compute.service",
            "vgpumgr.service"} <= before
    assert not after & before
    assert "Requires" not in u["Unit"]  # a failed restore is reported, it does not keep the guests down
    assert u["Install"]["WantedBy"] == ["multi-user.target"]


def test_api_units_agree_on_the_socket(units: dict[str, Path]) -> None:
    sock = parse_unit(units["vgpumgr.socket"].read_text())
    svc = parse_unit(units["vgpumgr.service"].read_text())
    assert sock["Socket"]["ListenStream"] == [DEFAULT_SOCKET]
    assert sock["Socket"]["SocketMode"] == ["0660"]
    assert sock["Socket"]["Service"] == ["vgpumgr.service"]
    argv = svc["Service"]["ExecStart"][0].split()
    assert argv[1] == "serve" and argv[argv.index("--socket") + 1] == DEFAULT_SOCKET
    assert "vgpumgr.socket" in svc["Unit"]["Requires"] and "vgpumgr.socket" in svc["Unit"]["After"]


def test_install_units_refuses_bad_targets(tmp_path: Path) -> None:
    rc, _, err = run("install-units", "--dest", str(tmp_path / "missing"), "--bin", str(VGPUMGR))
    assert rc == 3 and "is not a directory" in err
    rc, _, err = run("install-units", "--dest", str(tmp_path), "--bin", str(tmp_path / "no-such-vgpumgr"))
    assert rc == 3 and "not an executable file" in err
    rc, _, err = run("install-units", "--dest", str(tmp_path), "--bin", "relative/vgpumgr")
    assert rc == 2 and "ExecStart" in err
    assert list(tmp_path.iterdir()) == []  # nothing written on any of these


def test_listen_fds_only_for_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LISTEN_PID", str(os.getpid() + 1))
    monkeypatch.setenv("LISTEN_FDS", "1")
    assert systemd_socket() is None
    monkeypatch.setenv("LISTEN_PID", str(os.getpid()))
    monkeypatch.setenv("LISTEN_FDS", "2")
    with pytest.raises(InvalidInput, match="exactly one"):
        systemd_socket()
    assert "LISTEN_FDS" not in os.environ and "LISTEN_PID" not in os.environ


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate missing")
def test_serve_uses_the_socket_systemd_passes(tmp_path: Path) -> None:
    root = make(tmp_path, "t4").root
    activated, own = tmp_path / "activated.sock", tmp_path / "own.sock"
    env = [f"-E{k}={v}" for k, v in {"VGPUMGR_STATE_DIR": tmp_path / "state", "HOME": tmp_path,
                                      "VGPUMGR_LIBVIRT_URI": "test:///default", "PATH": os.environ["PATH"]}.items()]
    proc = subprocess.Popen(["systemd-socket-activate", "-l", str(activated), *env, str(VGPUMGR),
                             "--sysfs-root", str(root), "serve", "--socket", str(own), "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(100):
            if activated.is_socket():
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(activated)), base_url="http://vgpumgr",
                          timeout=60) as client:
            r = client.get("/v1/health")
        assert r.status_code == 200, r.text
        assert r.json()["simulated"] is True
        assert not own.exists()  # the path it would bind by itself was never used
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    assert "Traceback" not in err, err
