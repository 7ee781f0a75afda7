"""Several simulated hosts, each its own `python -m api.server` on its own unix socket, all on one database: a
fleet for tests and for scripts/bench_fleet.py. Each host has its own simulated sysfs root, state directory and
host name (VGPUMGR_HOSTNAME) and publishes on a short heartbeat."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from vgpumgr.sim import profiles
from vgpumgr.sim.platform import nvml_state_path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class FleetHost:
    name: str
    root: Path
    sock: Path
    proc: subprocess.Popen[bytes]
    log: Path
    token: str
    env: dict[str, str] = field(default_factory=dict)

    def client(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)), base_url="http://vgpumgr",
                            headers={"Authorization": f"Bearer {self.token}"}, timeout=timeout)

    def get(self, path: str, **params: Any) -> Any:
        with self.client() as c:
            r = c.get(path, params=params)
        assert r.status_code == 200, r.text
        return r.json()

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        with self.client() as c:
            return c.post(path, json=body)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def set_driver_version(root: Path, version: str) -> None:
    """The simulated NVML's host driver (vGPU manager) version."""
    path = nvml_state_path(root)
    state = json.loads(path.read_text())
    state["driver_version"] = version
    path.write_text(json.dumps(state))


class Fleet:
    def __init__(self, tmp: Path, db_url: str, token: str, heartbeat_s: float = 0.5) -> None:
        self.tmp, self.db_url, self.token, self.heartbeat_s = tmp, db_url, token, heartbeat_s
        self.sock_dir = Path(tempfile.mkdtemp(prefix="vgf-"))  # unix socket paths must stay short
        self.hosts: dict[str, FleetHost] = {}

    def add(self, name: str, profile: str, *, vfs: int | None = None, driver_version: str | None = None,
            **env: str) -> FleetHost:
        root = profiles.create(self.tmp / name / "sim", profile, vfs=vfs)
        if driver_version:
            set_driver_version(root, driver_version)
        testhost = self.tmp / name / "testhost.xml"
        testhost.write_text("<node><cpu><mode>host-passthrough</mode></cpu></node>\n")
        sock = self.sock_dir / f"{name}.sock"
        log = self.tmp / name / "server.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("VGPUMGR_")}
        full_env.update(VGPUMGR_HOSTNAME=name, VGPUMGR_FLEET_HEARTBEAT=str(self.heartbeat_s),
                        VGPUMGR_LICENCE_MODE="off", VGPUMGR_DB=self.db_url, **env)
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "api.server", "--uds", str(sock), "--sysfs-root",
                                     str(root), "--state-dir", str(self.tmp / name / "state"), "--connect",
                                     f"test://{testhost}", "--db", self.db_url], cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, env=full_env)
        host = self.hosts[name] = FleetHost(name, root, sock, proc, log, self.token, full_env)
        return host

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Every host answers on its socket and has published itself."""
        deadline = time.monotonic() + timeout
        for h in self.hosts.values():
            while True:
                if not h.alive:
                    raise RuntimeError(f"{h.name} exited: {h.log.read_text()[-3000:]}")
                if h.sock.exists():
                    try:
                        published = {r["host"] for r in h.get("/v1/fleet/hosts")}
                        if h.name in published:
                            break
                    except (httpx.HTTPError, AssertionError):
                        pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{h.name} did not start: {h.log.read_text()[-3000:]}")
                time.sleep(0.1)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        h = self.hosts[name]
        h.proc.send_signal(sig)
        h.proc.wait(timeout=10)

    def stop(self) -> None:
        for h in self.hosts.values():
            if h.alive:
                h.proc.terminate()
        for h in self.hosts.values():
            try:
                h.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                h.proc.kill()
                h.proc.wait(timeout=10)
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def publish_synthetic(db_url: str, name: str, gpus: list[Any], *, cordon: str | None = None,
                      stale: bool = False, heartbeat_s: float = 30.0) -> None:
    """A host that exists only as the rows it publishes, written by vgpumgr's own publishing code (`gpus`:
    vgpumgr.fleet.capacity.GpuCapacity); `stale`: its last heartbeat an hour ago."""
    from sqlalchemy import text

    from vgpumgr.db import store as db_store
    from vgpumgr.db.session import session_factory
    from vgpumgr.fleet import cordon as cordons
    from vgpumgr.fleet import writes

    with session_factory(db_url).begin() as s:
        host_id = db_store.upsert_host(s, name).id
        writes.write_gpus(s, host_id, gpus, prune_types=True)
        writes.write_host(s, host_id, writes.HostFacts(f"https://{name}.example:8470", f"qemu+ssh://{name}/system",
                                                     "580.159.04", "synthetic", heartbeat_s, heartbeat_s * 3),
                         len(gpus), sum(g.vgpus for g in gpus))
        if cordon:
            cordons.set_cordon(s, host_id, cordon, "test")
        if stale:
            past = "now() - interval '1 hour'" if s.get_bind().dialect.name == "postgresql" else \
                "strftime('%Y-%m-%d %H:%M:%f', 'now', '-1 hour')"
            s.execute(text(f"UPDATE fleet_hosts SET heartbeat_at = {past} WHERE host_id = :h"), {"h": host_id})


def board_capacity(tmp: Path, profile: str, scale: int = 1, vfs: int | None = None,
                   fill: dict[int, tuple[str, int]] | None = None) -> list[Any]:
    """A simulated board's GPUs as vgpumgr publishes them, with vGPUs really made on it first: `fill` maps a GPU's
    index to (type, how many)."""
    from vgpumgr.config import Config
    from vgpumgr.fleet.capacity import host_capacity
    from vgpumgr.placement.placer import Policy
    from vgpumgr.service import Service

    root = profiles.create(tmp / f"board-{profile}-{len(list(tmp.glob('board-*')))}", profile, scale=scale, vfs=vfs)
    old = os.environ.get("VGPUMGR_FLEET_PUBLISH")
    os.environ["VGPUMGR_FLEET_PUBLISH"] = "0"
    try:
        svc = Service(Config.resolve(sysfs_root=str(root), state_dir=str(root / ".board-state")), licence_mode="off")
    finally:
        os.environ.pop("VGPUMGR_FLEET_PUBLISH") if old is None else os.environ.update(VGPUMGR_FLEET_PUBLISH=old)
    gpus = sorted(g.address for g in svc.snapshot().inventory.gpus if not g.is_vf)
    for index, (vtype, count) in (fill or {}).items():
        for _ in range(count):
            svc.allocate(vtype, policy=Policy(pin_gpu=gpus[index]))
    from vgpumgr.ops.allocate import live_records

    with svc.reads() as s:
        records = live_records(svc, s)
    return host_capacity(svc.snapshot(refresh=True).placer, records)


def t4_service(tmp_path: Path, url: str, monkeypatch: Any, name: str, publish: str = "1") -> Any:
    """An in-process Service on a simulated 2 x T4 host named `name`, publishing each change (`publish`: "1") or
    nothing ("0") into `url`."""
    from vgpumgr.config import Config
    from vgpumgr.service import Service

    monkeypatch.setenv("VGPUMGR_HOSTNAME", name)
    monkeypatch.setenv("VGPUMGR_FLEET_PUBLISH", publish)
    root = profiles.create(tmp_path / f"sim-{name}", "t4", scale=2)
    return Service(Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / f"state-{name}"), db=url),
                   licence_mode="off")
