"""Two or more simulated hosts, each with its own vgpumgr service on its own unix socket, its own records and
its own simulated libvirtd (vgpumgr.sim.libvirtd: libvirt's migration order, the real hook script), for
migrations between them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hookserver import LIBVIRT, Server, running_server

from api import tokens
from vgpumgr.audit import chain as audit
from vgpumgr.db.session import session_factory
from vgpumgr.service import Service
from vgpumgr.sim.libvirtd import CONFIG, SCHEME


@dataclass
class SimHost:
    name: str
    server: Server
    svc: Service
    operator_token: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.server.cfg.state_dir}"

    @property
    def api(self) -> str:
        return f"unix:{self.server.sock}"

    def live(self, vm: str | None = None) -> list[dict[str, Any]]:
        return self.svc.allocations(vm=vm, live=True)

    def devices(self) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
        return self.server.mdevs(), self.server.vf_types()

    def domains(self) -> dict[str, str]:
        with self.svc.virt() as v:  # a fresh connection: the saved test-driver state as it is now
            return {d["name"]: d["state"] for d in v.list()}

    def events(self, action: str | None = None) -> list[Any]:
        with session_factory(self.server.cfg.db_url)() as s:
            return [e for e in audit.query(s, host=self.name) if action is None or e.action == action]


@contextmanager
def sim_hosts(tmp: Path, *profiles: str, licence_mode: str = "warn", db: str | None = None, vfs: int | None = 4,
              env_extra: dict[str, str] | None = None, scale: int = 1) -> Iterator[list[SimHost]]:
    with ExitStack() as stack:
        hosts = []
        for n, profile in enumerate(profiles):
            name = f"host-{chr(ord('a') + n)}"
            srv = stack.enter_context(running_server(tmp / name, profile, vfs=vfs, licence_mode=licence_mode, db=db,
                                                     hostname=name, env_extra=env_extra, scale=scale))
            srv.cfg.state_dir.mkdir(parents=True, exist_ok=True)  # a host on PostgreSQL may not have made it yet
            (srv.cfg.state_dir / CONFIG).write_text(json.dumps({
                "hook": str(LIBVIRT), "env": {"VGPUMGR_SOCKET": str(srv.sock), "VGPUMGR_TOKEN": srv.token,
                                              "VGPUMGR_HOOK_TIMEOUT": "60", "VGPUMGR_RELEASE_GRACE": "0",
                                              "VGPUMGR_HOSTNAME": name},
                "sysfs_root": str(srv.root), "uri": srv.cfg.libvirt_uri}))
            hosts.append(SimHost(name, srv, _service(srv, name, licence_mode),
                                 tokens.create_token(srv.cfg, f"migrator-{name}", "operator")))
        yield hosts


def _service(srv: Server, name: str, licence_mode: str) -> Service:
    import os

    os.environ["VGPUMGR_HOSTNAME"] = name  # the in-process service names itself as its server does
    try:
        return Service(srv.cfg, licence_mode=licence_mode)
    finally:
        del os.environ["VGPUMGR_HOSTNAME"]
