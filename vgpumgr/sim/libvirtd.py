"""A live migration between two simulated hosts, as libvirtd carries it out, hooks included.

libvirt's test driver cannot migrate, so for a destination URI `vgpumgr+sim:///<dest state dir>` the
simulated platform plays both libvirt daemons, in libvirt's order (docs/sources.md §18):

  destination  `migrate begin` (a filter: its stdout is the new XML; a non-zero exit cancels)
               `prepare begin`, `start begin`, `started begin`       (the incoming QEMU starts)
  transfer     job statistics move from all data remaining to none   (crash point `migrate-transfer`)
  destination  the domain is defined there (persistent) and runs on    (crash point `migrate-finished`)
  source       the domain stops: `stopped end`, `release end`; it is undefined here

A migration that fails after the destination prepared ends there with `stopped end` and `release end`
(`VGPUMGR_SIM_MIGRATION_FAIL=transfer` makes the transfer fail, for tests); the source keeps running.
`--offline` runs only `migrate begin` and moves the definition. Each simulated daemon is described by
`sim-libvirtd.json` in its host's state dir: {"hook": path of the qemu hook, "env": {...}, "sysfs_root": dir,
"uri": its test-driver URI}.
A running guest's vGPU instances in the simulated NVML (vgpumgr.sim.guests) move with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vgpumgr.errors import Conflict, InvalidInput, Unavailable, VgpuError

SCHEME = "vgpumgr+sim://"
CONFIG = "sim-libvirtd.json"
FAIL_ENV = "VGPUMGR_SIM_MIGRATION_FAIL"


class Daemon:
    """One simulated host's libvirtd: its test-driver domains (vgpumgr.virt.driver's saved state) and its hook."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        path = state_dir / CONFIG
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise Unavailable(f"no simulated libvirtd at {state_dir}: {path} is missing or unreadable ({exc})",
                              hint="a simulated destination needs its sim-libvirtd.json (see vgpumgr.sim.libvirtd)"
                              ) from exc
        self.hook = cfg.get("hook")
        self.env = {str(k): str(v) for k, v in (cfg.get("env") or {}).items()}
        self.sysfs_root = cfg.get("sysfs_root")
        self.uri = cfg.get("uri") or "test:///default"

    @classmethod
    def of(cls, state_dir: Path) -> Daemon | None:
        return cls(state_dir) if (state_dir / CONFIG).is_file() else None

    def virt(self) -> Any:
        from vgpumgr.virt.driver import Virt

        return Virt(self.uri, state_dir=self.state_dir)

    def run_hook(self, domain: str, op: str, sub: str, xml: str) -> tuple[int, str, str]:
        if not self.hook:
            return 0, "", ""
        proc = subprocess.run([sys.executable, self.hook, domain, op, sub, "-"], input=xml, text=True,
                              capture_output=True, env={**os.environ, **self.env}, timeout=120, check=False)
        return proc.returncode, proc.stdout, proc.stderr


class SimMigration:
    def __init__(self, uri: str) -> None:
        path = uri[len(SCHEME):]
        if not path.startswith("/") or ".." in Path(path).parts:
            raise InvalidInput(f"'{uri}' does not name a simulated host", hint=f"use {SCHEME}/ABSOLUTE/STATE/DIR")
        self.dest = Daemon(Path(path))

    def migrate(self, svc: Any, name: str, to: str, *, xml: str | None = None, offline: bool = False,
                progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        from vgpumgr.ops.leases import crash_point

        source = Daemon.of(Path(svc.cfg.state_dir))
        src_virt = svc.virt()
        xml = xml or src_virt.xml(name, inactive=offline, migratable=True)
        rc, out, err = self.dest.run_hook(name, "migrate", "begin", xml)
        if rc != 0:
            raise Conflict(f"the destination refused the migration at `migrate begin`: {err.strip() or rc}",
                           hint="nothing was changed on either host; `vgpumgr vm migrate --dry-run` says why")
        new_xml = out.strip() or xml
        dest_virt = self.dest.virt()
        if offline:
            dest_virt.define(new_xml, validate=False)
            src_virt.undefine(name)
            return {}
        rc, _out, err = self.dest.run_hook(name, "prepare", "begin", new_xml)
        if rc != 0:
            self.dest.run_hook(name, "release", "end", new_xml)
            raise Conflict(f"the destination could not prepare the domain: {err.strip() or rc}",
                           hint="nothing was changed on the source; the destination released what it reserved")
        for op in ("start", "started"):
            self.dest.run_hook(name, op, "begin", new_xml)
        try:
            stats = self._transfer(progress, crash_point)
        except VgpuError:
            self.dest.run_hook(name, "stopped", "end", new_xml)
            self.dest.run_hook(name, "release", "end", new_xml)
            raise
        # libvirt's Finish (the destination runs on, persistent) comes before its Confirm (the source stops)
        dest_virt.define(new_xml, validate=False)
        dest_virt.start(name)
        crash_point("migrate-finished")
        guests = self._stop_guests(svc, src_virt, name)
        src_virt.stop(name)
        if source is not None:
            source.run_hook(name, "stopped", "end", xml)
            source.run_hook(name, "release", "end", xml)
        src_virt.undefine(name)
        self._start_guests(new_xml, guests)
        return stats

    @staticmethod
    def _transfer(progress: Callable[[dict[str, Any]], None] | None, crash_point: Callable[[str], None]
                  ) -> dict[str, Any]:
        total = 64 << 20
        stats: dict[str, Any] = {}
        for step in range(5):
            crash_point("migrate-transfer")
            if os.environ.get(FAIL_ENV) == "transfer" and step == 2:
                raise VgpuError("the migration job failed during the transfer (simulated)",
                                hint="the VM keeps running on the source")
            done = total * (step + 1) // 5
            stats = {"type": 2, "data_total": total, "data_processed": done, "data_remaining": total - done,
                     "time_elapsed": 40 * (step + 1)}
            if progress:
                progress(dict(stats))
            time.sleep(0.01)
        stats["downtime"] = 12
        return stats

    @staticmethod
    def _stop_guests(svc: Any, virt: Any, name: str) -> list[dict[str, Any]]:
        """A running guest's vGPU instances end on the source (they continue at the destination)."""
        from vgpumgr.sim import guests
        from vgpumgr.sim.paths import nvml_state_path

        if not nvml_state_path(svc.host.root).is_file():
            return []
        uuid = next((d["uuid"] for d in virt.list() if d["name"] == name), None)
        stopped = []
        for inst in guests.running(svc.host.root):
            if uuid and inst["vm_uuid"] == uuid.lower():
                stopped.append(guests.stop(svc.host.root, inst["id"]))
        return stopped

    def _start_guests(self, xml: str, stopped: list[dict[str, Any]]) -> None:
        from vgpumgr.sim import guests
        from vgpumgr.virt import migration_xml as migration

        if not stopped or not self.dest.sysfs_root:
            return
        vm_uuid = migration.domain_uuid(xml)
        for v in migration.incoming_vgpus(xml):
            try:
                guests.start(self.dest.sysfs_root, v.ref, vm_uuid=vm_uuid or stopped[0]["vm_uuid"],
                             vm_name=stopped[0].get("vm_name"), guest_driver=stopped[0].get("guest_driver"))
            except ValueError:
                continue  # the destination GPU has no simulated NVML
