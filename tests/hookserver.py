"""The vgpumgr REST service on a unix socket over a simulated host, for running the hook scripts as their
callers do (arguments, stdin, environment)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from api import tokens
from vgpumgr.config import Config
from vgpumgr.discovery.inventory import scan
from vgpumgr.hostfs.root import Host
from vgpumgr.sim import profiles

REPO = Path(__file__).resolve().parents[1]
PROXMOX = REPO / "scripts/hooks/proxmox-vgpumgr"
LIBVIRT = REPO / "scripts/hooks/libvirt-qemu"


@dataclass
class Server:
    root: Path
    sock: Path
    token: str
    conf_dir: Path
    cfg: Config
    # the service's process stopped and started again on the same host and database
    stop_service: Callable[[], None] = field(default=lambda: None, repr=False)
    start_service: Callable[[], None] = field(default=lambda: None, repr=False)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VGPUMGR_")}
        env.update(VGPUMGR_SOCKET=str(self.sock), VGPUMGR_TOKEN=self.token, VGPUMGR_PVE_CONF_DIR=str(self.conf_dir),
                   VGPUMGR_RELEASE_GRACE="0", VGPUMGR_HOOK_TIMEOUT="20")
        env.update(extra)
        return env

    def mdevs(self) -> dict[str, tuple[str, str]]:
        return {m.uuid: (m.parent, m.type) for m in scan(Host(self.root)).mdevs}

    def vf_types(self) -> dict[str, str]:
        """VF address -> type for the VFs that hold a vGPU type now."""
        return {v.address: v.type for v in scan(Host(self.root)).vf_vgpus}


@contextmanager
def running_server(tmp: Path, profile: str, scale: int = 1, vfs: int | None = None,
                   licence_mode: str = "warn", db: str | None = None, hostname: str | None = None,
                   env_extra: dict[str, str] | None = None) -> Iterator[Server]:
    """`db`: a database URL (default SQLite in the state dir); `hostname`: the name this host goes by in a
    database several hosts share; `env_extra`: more VGPUMGR_* settings for the server."""
    root = profiles.create(tmp / "sim", profile, scale=scale, vfs=vfs)
    testhost = tmp / "testhost.xml"
    testhost.write_text("<node><cpu><mode>host-passthrough</mode></cpu></node>\n")
    cfg = Config.resolve(sysfs_root=str(root), state_dir=str(tmp / "state"), connect=f"test://{testhost}", db=db)
    token = tokens.create_token(cfg, f"hook-{hostname}" if hostname else "hook", "hook")
    sock_dir = Path(tempfile.mkdtemp(prefix="vgh-"))  # unix socket paths must stay short
    sock = sock_dir / "api.sock"
    log = open(tmp / "server.log", "w")  # noqa: SIM115
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGPUMGR_")}
    env["VGPUMGR_LICENCE_MODE"] = licence_mode
    if hostname:
        env["VGPUMGR_HOSTNAME"] = hostname
    env.update(env_extra or {})
    argv = [sys.executable, "-m", "api.server", "--uds", str(sock), "--sysfs-root", str(root),
            "--state-dir", str(cfg.state_dir), "--connect", cfg.libvirt_uri, *(["--db", db] if db else [])]
    procs = []

    def start() -> None:
        sock.unlink(missing_ok=True)
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append(proc)
        deadline = time.monotonic() + 60
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {(tmp / 'server.log').read_text()}")
            time.sleep(0.05)

    def stop() -> None:
        proc = procs[-1]
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)

    try:
        start()
        conf_dir = tmp / "pve/qemu-server"
        conf_dir.mkdir(parents=True)
        yield Server(root, sock, token, conf_dir, cfg, stop, start)
    finally:
        if procs:
            stop()
        log.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def run(argv: list[str], env: dict[str, str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, input=stdin, env=env, capture_output=True, text=True, timeout=90)
