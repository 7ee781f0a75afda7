"""Fixtures for live migration between two libvirt hosts in the Debian 13 lab guest
(scripts/mdev-lab-trixie run --hosts 2; lab_hosts.py says how the hosts are laid out).

The session starts one vgpumgr service per host on its own socket, with its own records, and writes each
host's hook token where that host's libvirt hook looks for it. Every test here is skipped outside such a guest.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_hosts import LabHost, in_migration_lab, wait_for

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs the Debian 13 lab guest with two libvirt hosts "
                                   "(scripts/mdev-lab-trixie run --hosts 2)")
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.lab)
            if not in_migration_lab():
                item.add_marker(skip)


@pytest.fixture(scope="session")
def hosts() -> Iterator[tuple[LabHost, LabHost]]:
    """Hosts a and b, each with its vgpumgr service running (REST on its own socket, its own database)."""
    a, b = LabHost("a"), LabHost("b")
    started = time.monotonic()
    # libvirtd probes QEMU's capabilities on first use (tens of seconds under TCG): let both do it meanwhile
    warmups = [subprocess.Popen(["virsh", "-c", h.uri, "domcapabilities", "--virttype", "qemu"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for h in (a, b)]
    tokens = [subprocess.Popen(["lab-host", h.name, "python", str(HERE / "lab_hosts.py"), "tokens"])
              for h in (a, b)]
    for p in tokens:
        assert p.wait(timeout=300) == 0, "writing a lab host's tokens failed"
    services = []
    for h in (a, b):
        log = open(h.dir / "log-libvirt" / "vgpumgr.log", "ab")  # noqa: SIM115 - closed at teardown
        env = dict(os.environ, VGPUMGR_DOMAIN_TYPE="qemu")
        services.append((subprocess.Popen(["lab-host", h.name, "vgpumgr", "serve", "--socket",
                                           "/run/vgpumgr/api.sock"], stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True), log))
    for h, (proc, _) in zip((a, b), services, strict=True):
        def ready(h: LabHost = h, proc: subprocess.Popen[bytes] = proc) -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"{h}'s vgpumgr service exited: {(h.dir / 'log-libvirt/vgpumgr.log').read_text()}")
            with contextlib.suppress(OSError):
                return h.api("GET", "/v1/vgpus")[0] == 200
            return False

        wait_for(f"{h}'s vgpumgr service", ready, timeout=300, every=1)
    for w in warmups:
        w.wait(timeout=300)
    print(f"\n[lab hosts] a and b ready with their vgpumgr services in {time.monotonic() - started:.0f} s")
    yield a, b
    for proc, log in services:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        log.close()


@pytest.fixture
def vm_name(request: pytest.FixtureRequest, hosts: tuple[LabHost, LabHost]) -> Iterator[str]:
    """A fresh domain name; afterwards the domain is removed from both hosts and its vGPUs released on both."""
    name = "mig-" + re.sub(r"[^a-z0-9]", "", request.node.name.removeprefix("test_"))[:24]
    yield name
    for h in hosts:
        h.remove_domain(name)
    for h in hosts:
        for v in h.vgpus(name):
            h.api("DELETE", f"/v1/vgpus/{v['uuid']}")
