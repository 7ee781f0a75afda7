"""`vgpumgr vm migrate` killed (SIGKILL) at random points and inside its windows: once the next allocation or
`reconcile --fix` has run, neither host keeps a reservation, a device or a seat that no domain there uses.

The destination's incoming reservations are owned by its service with a short lease (VGPUMGR_INCOMING_GRACE,
1 s here): a migration that never finished lapses and is rolled back; one that did is kept (its domain uses
the devices)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from migration_hosts import SimHost, sim_hosts

from vgpumgr.virt import domain

VGPUMGR = str(Path(sys.executable).with_name("vgpumgr"))


def args(h: SimHost) -> list[str]:
    return ["--sysfs-root", str(h.server.root), "--state-dir", str(h.server.cfg.state_dir),
            "--connect", h.server.cfg.libvirt_uri]


def env(h: SimHost, **extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("VGPUMGR_")}
    return {**e, "VGPUMGR_HOSTNAME": h.name, **extra}


def consistent(h: SimHost, other: SimHost) -> list[str]:
    """What does not add up on one host: records without devices or domains, devices nobody records, domains
    whose vGPUs have no record. One leftover is libvirt's own, not vgpumgr's: the kill stands for libvirtd dying
    inside its Confirm step after the source's QEMU stopped and its release hook ran, before the source's
    definition was removed; that shut-off definition's vGPU is released while the VM runs on `other`."""
    h.svc.invalidate()
    with h.svc.virt() as v:
        listing = v.list()
        domains = {d["name"]: set(domain.referenced_devices(v.xml(d["name"]))["mdev"]) for d in listing}
        confirm_cut = {d["name"] for d in listing if d["state"] != "running"} & {
            n for n, state in other.domains().items() if state == "running"}
    live = {a["uuid"]: a for a in h.live() if a["uuid"]}
    problems = [f"{u} of {a['vm']}: {a['state']}{' (owned)' if a.get('incoming') else ''}, "
                f"no domain here uses it" for u, a in live.items()
                if a["vm"] != "filler" and u not in domains.get(a["vm"], set())]
    problems += [f"mdev {u} has no record" for u in set(h.server.mdevs()) - set(live)]
    problems += [f"domain {d} uses {sorted(u - set(live))} without a record"
                 for d, u in domains.items() if u - set(live) and d not in confirm_cut]
    return problems


def test_killed_migrations_leave_nothing_behind_once_reaped(tmp_path: Path) -> None:
    seed = int(os.environ.get("VGPUMGR_TEST_SEED", time.time()))
    rng = random.Random(seed)
    with sim_hosts(tmp_path, "mixed", "mixed", env_extra={"VGPUMGR_INCOMING_GRACE": "1"}) as (a, b):
        vms = [f"k{n}" for n in range(6)]
        for vm in vms:
            a.svc.create_vm(vm, vgpus=["T4-1Q"], start=True)
        points = ["migrate-transfer", "migrate-finished", None, None, None, None]
        for vm, point in zip(vms, points, strict=True):
            extra = {"VGPUMGR_TO_TOKEN": b.operator_token}
            if point:
                extra["VGPUMGR_TEST_CRASH_POINT"] = f"{point}:30"
            p = subprocess.Popen([VGPUMGR, *args(a), "vm", "migrate", vm, "--to", b.uri, "--to-api", b.api, "--json"],
                                 env=env(a, **extra), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if point:
                for line in p.stderr:  # the process says when it stands in the window
                    if f"vgpumgr-crash-point {point}" in line:
                        break
            else:
                time.sleep(rng.uniform(0.3, 4.0))
            p.send_signal(signal.SIGKILL)
            p.wait()
            p.stderr.close()
        time.sleep(1.5)  # past the destination's incoming lease
        # the next allocation on the destination rolls back what lapsed; reconcile --fix on the source
        b.svc.allocate("T4-1Q", vm="filler")
        r = subprocess.run([VGPUMGR, *args(a), "reconcile", "--fix", "--json"], env=env(a), capture_output=True,
                           text=True, timeout=120)
        assert r.returncode in (0, 10), r.stderr
        assert consistent(a, b) == [] and consistent(b, a) == [], f"seed {seed}"
        # every VM is somewhere, running, exactly once or (killed after the destination ran it but before the
        # source stopped it: libvirt's own confirm step is what the kill took away) on both
        where = {vm: [h.name for h in (a, b) if h.domains().get(vm) == "running"] for vm in vms}
        assert all(where[vm] for vm in vms), (where, seed)
        rollbacks = [e for e in b.events("vgpu.rollback") if e.outcome == "ok"]
        assert rollbacks, "the kill inside the transfer should have left a reservation to roll back"
