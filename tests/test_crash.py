"""SIGKILL at random points of `vgpumgr vm create`, `vgpumgr vgpu`, `vgpumgr vm delete` and a REST create, then
count what leaked: allocations (reserved, still owned, without their device, or of a VM libvirt does not
have), licence seats without a live allocation, and devices nobody recorded.

Most runs are forked from this (already imported) interpreter and run the CLI's `main` or `vgpumgr serve`
there, so 50+ real process deaths fit in about a minute on two cores; a few are whole `vgpumgr` processes.
Half the kills land at random times; the other half inside a named crash window (VGPUMGR_TEST_CRASH_POINT
makes the process pause there and say so on stderr), at a random moment of that pause.

The seed is printed on failure; VGPUMGR_CRASH_SEED=N repeats a run.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from vgpumgr.config import Config
from vgpumgr.db import store
from vgpumgr.db.session import dispose_engines
from vgpumgr.discovery.mdev import discover_mdevs
from vgpumgr.licensing import seats as licensing
from vgpumgr.service import Service
from vgpumgr.sim import profiles
from vgpumgr.virt.domain import referenced_devices
from vgpumgr.virt.driver import Virt

VGPUMGR = str(Path(sys.executable).with_name("vgpumgr"))
TYPE = "T4-1Q"
CLI_POINTS = {"vm create": ["reserved", "created", "allocated", "defined"], "vgpu": ["reserved", "created"],
              "vm delete": ["undefined"]}
REST_POINTS = ["claimed", "reserved", "created", "allocated", "defined"]
MARK = b"vgpumgr-crash-point"


class Host:
    def __init__(self, tmp: Path) -> None:
        self.root = profiles.create(tmp / "sim", "t4")
        self.state = tmp / "state"
        self.args = ["--sysfs-root", str(self.root), "--state-dir", str(self.state)]
        self.cfg = Config.resolve(sysfs_root=str(self.root), state_dir=str(self.state), connect="test:///default")
        self.svc = Service(self.cfg)
        self.seed = int(os.environ.get("VGPUMGR_CRASH_SEED") or time.time_ns() % 2**32)
        self.rng = random.Random(self.seed)
        self.n = 0

    def name(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"


@pytest.fixture
def host(tmp_path: Path) -> Host:
    h = Host(tmp_path)
    with h.svc.tx() as s:  # seats are taken (licence mode warn) and must all come back
        licensing.add_pool(s, name="lab", edition_name="vWS", seats=200)
    return h


# -- forked runs ------------------------------------------------------------------------------------------

def fork(argv: list[str], env: dict[str, str]) -> tuple[int, int]:
    """(pid, read end of its stderr): the CLI's main in a child of this interpreter."""
    dispose_engines()  # the child must not inherit open database connections
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        rc = 70
        try:
            os.close(r)
            os.dup2(w, 2)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.environ.update(env)
            from vgpumgr.cli.main import main

            with open(null, "w", closefd=False) as out, open(2, "w", closefd=False) as err:
                rc = main(argv, out=out, err=err)
        finally:
            os._exit(rc)
    os.close(w)
    return pid, r


def wait_mark(fd: int, timeout: float) -> bytes:
    """What the child wrote to stderr until it reached its crash point (or exited, or the time ran out)."""
    seen, deadline = b"", time.monotonic() + timeout
    while MARK not in seen and (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        seen += chunk
    return seen


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


def crash(h: Host, pid: int, fd: int, point: str | None, pause: float, random_delay: float) -> str:
    """Kill the child inside `point`'s pause (at a random moment of it) or after a random delay."""
    try:
        if point:
            seen = wait_mark(fd, 15.0)
            if MARK in seen:
                time.sleep(h.rng.uniform(0.0, pause * 0.8))
        else:
            time.sleep(h.rng.uniform(0.0, random_delay))
        kill(pid)
    finally:
        os.close(fd)
    return point or "random"


def cli_run(h: Host, command: str) -> str | None:
    """One killed CLI run of `command` ("vm create", "vgpu", "vm delete")."""
    if command == "vm delete":
        names = [d["name"] for d in Virt(h.cfg.libvirt_uri, state_dir=h.state).list()]
        if not names:
            return None
        argv = ["vm", "delete", h.rng.choice(names)]
    elif command == "vm create":
        argv = ["vm", "create", h.name("vm"), "--vgpu", TYPE]
    else:
        argv = ["vgpu", "--type", TYPE, "--vm", h.name("g")]
    point = h.rng.choice(CLI_POINTS[command]) if h.rng.random() < 0.5 else None
    pause = 0.4
    env = {"VGPUMGR_TEST_CRASH_POINT": f"{point}:{pause}"} if point else {}
    pid, fd = fork([*h.args, *argv], env)
    return crash(h, pid, fd, point, pause, random_delay=0.35)


def housekeeping(h: Host) -> None:
    """Keep capacity for the next runs: release finished `vgpu` allocations, delete some VMs (not killed)."""
    h.svc.invalidate()
    for a in h.svc.allocations(live=True):
        if a["state"] == "active" and (a["vm"] or "").startswith("g") and _owner(h, a["id"]) is None:
            h.svc.release(a["uuid"])
    names = [d["name"] for d in Virt(h.cfg.libvirt_uri, state_dir=h.state).list()]
    for name in names[: max(0, len(names) - 4)]:
        h.svc.delete_vm(name)


def _owner(h: Host, alloc_id: int) -> int | None:
    from vgpumgr.db.models import Allocation

    with h.svc.sessions() as s:
        return s.get(Allocation, alloc_id).owner_pid


# -- what leaked ----------------------------------------------------------------------------------------------

def leaks(h: Host) -> dict[str, list[Any]]:
    virt = Virt(h.cfg.libvirt_uri, state_dir=h.state)
    domains = {d["name"]: set(referenced_devices(virt.xml(d["name"]))["mdev"]) for d in virt.list()}
    mdevs = {m.uuid for m in discover_mdevs(h.cfg.host)}
    with h.svc.sessions() as s:
        hid = h.svc.host_id(s)
        names = {v.id: v.name for v in store.vms(s, hid)}
        live = store.allocations(s, hid, live=True)
        held = licensing.leases(s, held=True)
        live_vms = {a.vm_id for a in live}
        bad = []
        for a in live:
            vm = names.get(a.vm_id, "")
            why = ("reserved" if a.state == "reserved" else "still owned" if a.owner_pid is not None
                   else "no device" if a.uuid not in mdevs
                   else "VM libvirt does not know" if vm[:1] in ("v", "r") and a.uuid not in domains.get(vm, ())
                   else None)
            if why:
                bad.append(f"{a.uuid} ({vm}): {why}")
        seats = [f"seat of {names.get(lease.vm_id)}" for lease in held if lease.vm_id not in live_vms]
        seats += [f"{names.get(v)} holds no seat" for v in live_vms if v not in {lease.vm_id for lease in held}]
        live_uuids = {a.uuid for a in live}
    orphans = sorted(mdevs - live_uuids)
    broken = [f"{d}: {sorted(u - live_uuids)}" for d, u in domains.items() if u - live_uuids]
    return {"allocations": bad, "seats": seats, "orphan_devices": orphans, "domains_without_records": broken}


def assert_clean(h: Host, when: str) -> None:
    found = leaks(h)
    assert all(not v for v in found.values()), f"{when} (seed {h.seed}): {json.dumps(found, indent=1)}"


def run_cli_batch(h: Host, runs: int) -> list[str]:
    done = []
    commands = ["vm create", "vm create", "vgpu", "vm delete"]
    while len(done) < runs:
        if len(h.svc.allocations(live=True)) >= 10:
            housekeeping(h)
        got = cli_run(h, commands[len(done) % len(commands)] if h.rng.random() < 0.7 else h.rng.choice(commands))
        if got is not None:
            done.append(got)
    return done


# -- the tests ------------------------------------------------------------------------------------------------

def test_killed_cli_runs_are_cleaned_up_by_the_next_allocation(host: Host) -> None:
    h = host
    kinds = run_cli_batch(h, 24)
    for _ in range(2):  # whole processes as well: interpreter start-up and all
        p = subprocess.Popen([VGPUMGR, *h.args, "vm", "create", h.name("vm"), "--vgpu", TYPE],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(h.rng.uniform(0.3, 2.0))
        p.kill()
        p.wait()
    # the last kill is inside a vm create's window, so there is something to clean up (room made first: a
    # create refused for want of capacity would reach no window)
    housekeeping(h)
    pid, fd = fork([*h.args, "vm", "create", h.name("vm"), "--vgpu", TYPE],
                   {"VGPUMGR_TEST_CRASH_POINT": "allocated:5"})
    crash(h, pid, fd, "allocated", 0.1, 0)
    assert leaks(h)["allocations"], "the last kill should have left a dead reservation"
    pid, fd = fork([*h.args, "vgpu", "--type", TYPE, "--vm", "probe"], {})  # nothing else runs before it
    os.close(fd)
    assert os.waitpid(pid, 0)[1] == 0
    h.svc.invalidate()
    assert_clean(h, f"after {len(kinds) + 3} kills ({sorted(set(kinds))}) and one allocation")
    with h.svc.sessions() as s:
        from vgpumgr.audit import chain as audit

        rollbacks = [e for e in audit.query(s, action="vgpu.rollback")]
    assert rollbacks and all(e.detail["reason"] for e in rollbacks)


def test_killed_cli_runs_are_cleaned_up_by_reconcile_fix(host: Host) -> None:
    h = host
    run_cli_batch(h, 14)
    victim = h.name("vm")
    h.svc.create_vm(victim, vgpus=[TYPE])
    # item 2: a reservation whose device never appeared; then a delete dying between undefine and release
    # (it allocates nothing, so the reservation is still there for reconcile to find)
    for argv, point in ((["vm", "create", h.name("vm"), "--vgpu", TYPE], "reserved"),
                        (["vm", "delete", victim], "undefined")):
        pid, fd = fork([*h.args, *argv], {"VGPUMGR_TEST_CRASH_POINT": f"{point}:5"})
        crash(h, pid, fd, point, 0.1, 0)
    report = json.loads(subprocess.run([VGPUMGR, *h.args, "reconcile", "--json"], capture_output=True,
                                       text=True).stdout)
    dead = {d["ref"]: d for d in report["dead_reservations"]}
    assert len(dead) >= 2 and not set(dead) & set(report["missing"]), report
    assert {d["state"] for d in dead.values()} >= {"reserved", "active"}
    fixed = subprocess.run([VGPUMGR, *h.args, "reconcile", "--fix"], capture_output=True, text=True)
    assert fixed.returncode == 0 and "dead reservations:" in fixed.stdout, fixed.stdout + fixed.stderr
    assert "rolled back" in fixed.stdout
    h.svc.invalidate()
    assert not {m.uuid for m in discover_mdevs(h.cfg.host)} & set(dead)  # never re-created
    assert_clean(h, "after reconcile --fix")


def _rest_post(sock: str, token: str, name: str, key: str) -> socket.socket:
    body = json.dumps({"name": name, "vgpus": [TYPE]}).encode()
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.sendall(b"POST /v1/vms HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {token}\r\nIdempotency-Key: {key}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def _wait_socket(sock: str, pid: int | None = None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(sock)
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"vgpumgr serve did not listen on {sock} within {timeout} s")


def test_killed_rest_creates_are_cleaned_up_by_the_service_start(host: Host, tmp_path: Path) -> None:
    import uvicorn  # noqa: F401 - imported once here, not in every forked server

    from api import app  # noqa: F401
    from api.tokens import create_token

    h = host
    token = create_token(h.cfg, "crash", "operator")
    sock = str(tmp_path / "api.sock")
    serve = [*h.args, "serve", "--socket", sock, "--log-level", "warning"]
    for i in range(12):
        point = h.rng.choice(REST_POINTS) if i % 2 == 0 else None
        env = {"VGPUMGR_TEST_CRASH_POINT": f"{point}:0.4"} if point else {}
        pid, fd = fork(serve, env)
        try:
            _wait_socket(sock)
            conn = _rest_post(sock, token, h.name("r"), f"key-{i}")
        except BaseException:
            kill(pid)
            os.close(fd)
            raise
        crash(h, pid, fd, point, 0.4, random_delay=0.3)
        conn.close()
        if len(h.svc.allocations(live=True)) >= 10:
            housekeeping(h)
    # one last kill inside a create, then a whole `vgpumgr serve` process: its start must clean up
    pid, fd = fork(serve, {"VGPUMGR_TEST_CRASH_POINT": "allocated:5"})
    _wait_socket(sock)
    conn = _rest_post(sock, token, h.name("r"), "key-last")
    crash(h, pid, fd, "allocated", 0.1, 0)
    conn.close()
    assert leaks(h)["allocations"]
    p = subprocess.Popen([VGPUMGR, *serve], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_socket(sock)
        h.svc.invalidate()
        assert_clean(h, "after killed REST creates and a service start")
        # the killed request's key is taken over by its retry, which now completes once
        conn = _rest_post(sock, token, f"r{h.n}", "key-last")
        reply = conn.makefile("rb").readline()
        conn.close()
        assert b" 201 " in reply, reply
    finally:
        p.terminate()
        p.wait(10)
    h.svc.invalidate()
    assert_clean(h, "after the retried request")


# -- owners and leases, without killing anything ----------------------------------------------------------------

def _owned_by(h: Host, owners: list[tuple[int, int | None, float]]) -> list[str]:
    """vm create allocations, each handed to a process (pid, start time, lease seconds) as if it had made it."""
    from datetime import timedelta

    from sqlalchemy import update

    from vgpumgr.db.models import Allocation, utcnow
    from vgpumgr.ops import leases

    with leases.holding():
        made = [h.svc.allocate(TYPE, vm=h.name("vm")) for _ in owners]
    with h.svc.tx() as s:
        for a, (pid, started, seconds) in zip(made, owners, strict=True):
            s.execute(update(Allocation).where(Allocation.id == a["id"]).values(
                owner_pid=pid, owner_started=started, lease_until=utcnow() + timedelta(seconds=seconds)))
    return [a["uuid"] for a in made]


def test_a_live_owner_keeps_its_reservation_until_its_lease_expires(host: Host) -> None:
    from vgpumgr.ops import leases

    h, parent = host, os.getppid()
    started = leases.start_time(parent) or 0
    # alive; alive but its lease ran out; the same pid started at another time (a reused pid)
    held, expired, reused_pid = _owned_by(h, [(parent, started, 60), (parent, started, -1),
                                              (parent, started + 1, 60)])
    dead = {d.ref: d.reason for d in leases.find_dead(h.svc)}
    assert held not in dead
    assert "expired" in dead[expired] and "is gone" in dead[reused_pid]
    done = h.svc.reap_dead_reservations()
    assert {d["ref"] for d in done} == {expired, reused_pid} and all(d["device_removed"] for d in done)
    assert {m.uuid for m in discover_mdevs(h.cfg.host)} == {held}
    assert [a["uuid"] for a in h.svc.allocations(live=True)] == [held]


def test_reconcile_reports_dead_reservations_as_their_own_kind(host: Host) -> None:
    from vgpumgr.ops import leases

    h = host
    [gone] = _owned_by(h, [(2**22 + 7, 1, 60)])  # no such pid
    r = h.svc.reconcile()
    assert [d["ref"] for d in r["dead_reservations"]] == [gone] and r["missing"] == [] and r["unknown"] == []
    out = subprocess.run([VGPUMGR, *h.args, "reconcile"], capture_output=True, text=True)
    assert out.returncode == 10 and "dead reservations: 1" in out.stdout and gone in out.stdout, out.stdout
    assert leases.find_dead(h.svc)  # reporting changed nothing
