"""A fleet upgraded one host at a time (README, "Upgrading"): hosts on one PostgreSQL database, each its own
`vgpumgr serve` on its own simulated host, installed from wheels: this release, and a "next" release built from
a copy of this source with one more expand step and its contract step (the contract's content is a stand-in:
what is tested is the gate, not the table it drops).

VMs are started, stopped and migrated throughout through the real libvirt hook script, as libvirt calls it
(prepare/start on start, release on stop, migrate begin at the destination for a plain-libvirt migration). The
hosts are upgraded one by one; the contract step is refused while an older host is live, applied last; a host
still on the old release then stops with exit 11 and what to do, and its running service answers 503 with it.
At the end no record or seat is lost, every host's audit chain verifies and the fleet view shows every host on
the new release."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import wheels

pytestmark = pytest.mark.postgres

HOOK = wheels.REPO / "scripts/hooks/libvirt-qemu"
TYPE = "T4-4Q"

EXPAND = '''"""Test release: a table the next release uses.

Revision ID: 0{n}_probe_expand
Revises: {prev}
"""
import sqlalchemy as sa
from alembic import op

revision = "0{n}_probe_expand"
down_revision = "{prev}"
branch_labels = None
depends_on = None
phase = "expand"


def upgrade() -> None:
    op.create_table("probe_new", sa.Column("id", sa.Integer(), primary_key=True))
    op.create_table("probe_old", sa.Column("id", sa.Integer(), primary_key=True))


def downgrade() -> None:
    op.drop_table("probe_old")
    op.drop_table("probe_new")
'''
CONTRACT = '''"""Test release: a removal no code from 0{m}_probe_expand on needs.

Revision ID: 0{n}_probe_contract
Revises: 0{m}_probe_expand
"""
import sqlalchemy as sa
from alembic import op

revision = "0{n}_probe_contract"
down_revision = "0{m}_probe_expand"
branch_labels = None
depends_on = None
phase = "contract"
contract_min_code = "0{m}_probe_expand"


def upgrade() -> None:
    op.drop_table("probe_old")


def downgrade() -> None:
    op.create_table("probe_old", sa.Column("id", sa.Integer(), primary_key=True))
'''


def _make_next(src: Path) -> str:
    """Turn a copy of this source into the next release: version bumped, two schema steps more."""
    from vgpumgr.db import schema

    head = schema.SCHEMA_REVISION
    n = schema.code_ordinal() + 1
    versions = src / "migrations/versions"
    (versions / f"0{n:03d}_probe_expand.py").write_text(EXPAND.format(n=f"{n:03d}", prev=head))
    (versions / f"0{n + 1:03d}_probe_contract.py").write_text(CONTRACT.format(n=f"{n + 1:03d}", m=f"{n:03d}"))
    py = src / "pyproject.toml"
    py.write_text(re.sub(r'^version = "[^"]+"', 'version = "99.0.0"', py.read_text(), count=1, flags=re.M))
    new_head = f"0{n + 1:03d}_probe_contract"
    sch = src / "vgpumgr/db/schema.py"
    sch.write_text(sch.read_text().replace(f'SCHEMA_REVISION = "{head}"', f'SCHEMA_REVISION = "{new_head}"'))
    return new_head


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("releases")
    this = wheels.install(wheels.build_wheel(wheels.copy_sources(base / "this-src"), base / "this-dist"), base / "this")
    src = wheels.copy_sources(base / "next-src")
    _make_next(src)
    nxt = wheels.install(wheels.build_wheel(src, base / "next-dist"), base / "next")
    return {"this": this, "next": nxt}


@dataclass
class FleetHost:
    name: str
    dir: Path
    db: str
    release: Path  # bin/ of the installation it runs
    sock: Path
    token: str = ""
    proc: subprocess.Popen[str] | None = None
    domains: dict[str, str] = field(default_factory=dict)  # VM -> the domain XML it runs with here

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VGPUMGR_", "PYTHON"))}
        env.update(VGPUMGR_DB=self.db, VGPUMGR_HOSTNAME=self.name, VGPUMGR_STATE_DIR=str(self.dir / "state"),
                   VGPUMGR_SYSFS_ROOT=str(self.dir / "root"), VGPUMGR_LIBVIRT_URI="test:///default",
                   VGPUMGR_FLEET_HEARTBEAT="1", VGPUMGR_LICENCE_MODE="enforce", HOME=str(self.dir))
        return env

    def cli(self, *argv: str, release: Path | None = None, ok: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([str((release or self.release) / "vgpumgr"), *argv], cwd=self.dir, env=self.env(),
                           capture_output=True, text=True, timeout=120)
        assert p.returncode != 70, f"{self.name}: vgpumgr {' '.join(argv)}: internal error\n{p.stderr}"
        if ok:
            assert p.returncode == 0, f"{self.name}: vgpumgr {' '.join(argv)} exited {p.returncode}\n{p.stderr}"
        return p

    def start(self) -> None:
        self.sock.unlink(missing_ok=True)
        log = open(self.dir / "serve.log", "a")  # noqa: SIM115 - kept by the process
        self.proc = subprocess.Popen([str(self.release / "vgpumgr"), "serve", "--socket", str(self.sock),
                                      "--log-level", "warning"], cwd=self.dir, env=self.env(), stdout=log,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while not self.sock.is_socket():
            assert self.proc.poll() is None, (self.dir / "serve.log").read_text()
            assert time.monotonic() < deadline, "the service did not come up"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=20)
        self.proc = None

    def hook(self, vm: str, op: str, sub: str, xml: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": os.environ["PATH"], "VGPUMGR_SOCKET": str(self.sock), "VGPUMGR_TOKEN": self.token,
               "VGPUMGR_RELEASE_GRACE": "0", "VGPUMGR_HOOK_TIMEOUT": "60"}
        return subprocess.run([str(HOOK), vm, op, sub, "-"], input=xml, env=env, capture_output=True, text=True,
                              timeout=90)


@pytest.fixture
def fleet(releases: dict[str, Path], pg_server: object) -> Iterator[dict[str, FleetHost]]:
    db = pg_server.create_database("rolling")  # type: ignore[attr-defined]
    base = Path(tempfile.mkdtemp(prefix="vgr-"))  # unix socket paths must stay short
    hosts = {n: FleetHost(f"host-{n}", base / n, db, releases["this"], base / n / "api.sock") for n in "abcd"}
    try:
        for h in hosts.values():
            h.dir.mkdir(parents=True)
            h.cli("sim", "create", str(h.dir / "root"), "--profile", "t4")
        yield hosts
    finally:
        for h in hosts.values():
            h.stop()
        subprocess.run(["rm", "-rf", str(base)], check=False)


def _ok(p: subprocess.CompletedProcess[str], what: str) -> str:
    assert p.returncode == 0, f"{what}: exit {p.returncode}: {p.stderr}"
    return p.stdout


def start_vm(h: FleetHost, vm: str) -> None:
    xml = h.domains[vm]
    _ok(h.hook(vm, "prepare", "begin", xml), f"{h.name} prepare {vm}")
    _ok(h.hook(vm, "start", "begin", xml), f"{h.name} start {vm}")


def stop_vm(h: FleetHost, vm: str) -> None:
    _ok(h.hook(vm, "release", "end", h.domains[vm]), f"{h.name} release {vm}")


def migrate(src: FleetHost, dst: FleetHost, vm: str) -> None:
    """libvirt's order for a live migration it runs itself: the destination's migrate (its XML filter) and
    prepare, then the source's release."""
    xml = _ok(dst.hook(vm, "migrate", "begin", src.domains[vm]), f"{dst.name} migrate begin {vm}")
    dst.domains[vm] = xml
    _ok(dst.hook(vm, "prepare", "begin", xml), f"{dst.name} prepare {vm}")
    _ok(dst.hook(vm, "start", "begin", xml), f"{dst.name} start {vm}")
    stop_vm(src, vm)
    del src.domains[vm]


def cycle(hosts: list[FleetHost], moves: list[tuple[FleetHost, FleetHost]]) -> None:
    """One running VM of each host stopped and started again; then one VM moved along each of `moves`."""
    for h in hosts:
        for vm in sorted(h.domains)[-1:]:
            stop_vm(h, vm)
            start_vm(h, vm)
    for src, dst in moves:
        migrate(src, dst, sorted(src.domains)[0])


def running(h: FleetHost) -> dict[str, str]:
    rows = json.loads(h.cli("placements", "--json").stdout)
    return {r["vm"]: r["state"] for r in rows}


def test_a_fleet_upgraded_host_by_host(fleet: dict[str, FleetHost], releases: dict[str, Path]) -> None:
    a, b, c, d = (fleet[n] for n in "abcd")
    a.cli("db", "upgrade")
    a.cli("license", "add", "vws", "--edition", "vWS", "--seats", "20")
    for h in (a, b, c):
        h.token = h.cli("token", "create", "--name", f"hook-{h.name}", "--role", "hook").stdout.strip()
        h.start()
    for h, vms in ((a, ("a1", "a2")), (b, ("b1",)), (c, ("c1",))):
        for vm in vms:
            h.cli("vm", "create", vm, "--vgpu", TYPE)
            h.domains[vm] = h.cli("vm", "xml", vm).stdout
            start_vm(h, vm)
    cycle([a, b, c], [(a, b)])

    # host c gets the next release: its schema steps first (expand only), the old hosts keep working
    c.stop()
    c.release = releases["next"]
    out = c.cli("db", "upgrade").stdout
    assert re.search(r"applied 0\d+_probe_expand \(expand\)", out) and "held back" in out, out
    c.start()
    cycle([a, b, c], [(b, c), (c, a)])
    assert a.cli("placements", "--json", release=releases["this"]).returncode == 0  # old CLI, newer schema

    refused = c.cli("db", "upgrade", "--contract", ok=False)
    assert refused.returncode == 4, refused.stderr
    assert "host-a (vgpumgr 0.1.0)" in refused.stdout and "host-b (vgpumgr 0.1.0)" in refused.stdout, refused.stdout

    for h in (a, b):  # drain is the operator's (their VMs keep running here), then upgrade and restart
        h.stop()
        h.release = releases["next"]
        h.start()
        cycle([a, b, c], [(a, c)])

    # a forgotten host on the old release, live: it would hold the contract back; the operator retires it
    d.token = d.cli("token", "create", "--name", "hook-d", "--role", "hook").stdout.strip()
    d.start()
    d.cli("vm", "create", "d1", "--vgpu", TYPE)
    d.domains["d1"] = d.cli("vm", "xml", "d1").stdout
    start_vm(d, "d1")
    assert c.cli("db", "upgrade", "--contract", ok=False).returncode == 4
    out = c.cli("db", "upgrade", "--contract", "--ignore-host", "host-d").stdout
    assert re.search(r"applied 0\d+_probe_contract \(contract\)", out), out

    # the old release now stops with what to do: its CLI at once, its running service at its next heartbeat
    old = d.cli("placements", ok=False)
    assert old.returncode == 11, old.stderr
    assert "has been contracted" in old.stderr and "upgrade vgpumgr on this host" in old.stderr, old.stderr
    deadline = time.monotonic() + 15
    xml = d.domains["d1"]
    while True:  # release and start again until a hook call is refused (the heartbeat may see it between them)
        r = d.hook("d1", "release", "end", xml)
        released = r.returncode == 0
        r = r if r.returncode else d.hook("d1", "prepare", "begin", xml)
        r = r if r.returncode else d.hook("d1", "start", "begin", xml)
        if r.returncode:
            break
        assert time.monotonic() < deadline, "the old service kept serving a contracted schema"
        time.sleep(0.5)
    assert "contracted" in r.stderr, r.stderr
    d.stop()
    d.release = releases["next"]  # upgraded: it comes back with its record intact
    d.start()
    if released:  # the refusal came at the VM's start: the operator starts it again on the upgraded host
        start_vm(d, "d1")
    assert running(d) == {"d1": "active"}

    cycle([a, b, c], [(c, b)])
    # nothing lost: each VM's one vGPU record is where the VM runs, one seat per VM, chains verify
    want = {h.name: set(h.domains) for h in (a, b, c, d)}
    for h in (a, b, c, d):
        states = running(h)
        assert set(states) == want[h.name] and all(v == "active" for v in states.values()), (h.name, states)
        h.cli("audit", "verify")
    usage = json.loads(a.cli("license", "usage", "--json").stdout)
    assert usage[0]["used"] == sum(len(v) for v in want.values()) == 5, usage
    hosts = {r["host"]: r for r in json.loads(a.cli("fleet", "hosts", "--json").stdout)}
    for h in (a, b, c, d):
        assert hosts[h.name]["vgpumgr_version"] == "99.0.0" and not hosts[h.name]["stale"], hosts[h.name]
