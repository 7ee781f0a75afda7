"""`vgpumgr vm migrate NAME --to URI` between two real libvirt hosts, each with its own vgpumgr.

The VM is made by host A's vgpumgr (`vm create`), so its XML carries A's records in vgpumgr's metadata; the
lab adds only QEMU trace events and the device properties Debian 13's kernel needs (lab_hosts.for_the_lab).
The command runs on A's side with A's configuration (`lab-host a vgpumgr vm migrate ...`). Until the command
exists these tests are skipped, saying so.
"""

from __future__ import annotations

import functools
import json
import subprocess
import time
from typing import Any

import pytest
from lab_hosts import (
    MDEV_DEVICES,
    LabHost,
    for_the_lab,
    group_of,
    holds,
    in_migration_lab,
    mdev_uuids,
    vfio_trace,
    wait_for,
)

pytestmark = pytest.mark.lab


@functools.cache
def vm_migrate_missing() -> str | None:
    """Why the tests cannot run yet, or None."""
    if not in_migration_lab():
        return "needs the Debian 13 lab guest with two libvirt hosts"
    r = LabHost("a").cli("vm", "migrate", "--help", timeout=120)
    return None if r.returncode == 0 else "`vgpumgr vm migrate` does not exist yet (issue 20)"


@pytest.fixture(autouse=True)
def _needs_vm_migrate() -> None:
    reason = vm_migrate_missing()
    if reason:
        pytest.skip(reason)


def create_on_a(a: LabHost, name: str, vgpu: str = "mtty-1") -> str:
    """A's mdev for the VM `name`, which runs on A: made by `vgpumgr vm create` there, started after the lab's
    additions to its definition."""
    import libvirt

    vm = a.cli_json("vm", "create", name, "--vgpu", vgpu, "--memory", "64", "--vcpus", "1")
    [alloc] = vm["allocations"]
    dom = a.domain(name)
    a.conn().defineXML(for_the_lab(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)))
    a.domain(name).create()
    assert holds(a.qemu_pid(name), group_of(alloc["uuid"]))
    return alloc["uuid"]


def migrate(a: LabHost, name: str, b: LabHost) -> subprocess.CompletedProcess[str]:
    return a.cli("vm", "migrate", name, "--to", b.uri, "--json", timeout=600)


def both_hosts(a: LabHost, b: LabHost, name: str) -> dict[str, Any]:
    """What each host's vgpumgr, libvirtd and the kernel hold, for before/after comparisons."""
    return {"a_vgpus": [(v["uuid"], v["vm"], v["state"]) for v in a.vgpus()],
            "b_vgpus": [(v["uuid"], v["vm"], v["state"]) for v in b.vgpus()],
            "a_domains": sorted(d.name() for d in a.conn().listAllDomains(0)),
            "b_domains": sorted(d.name() for d in b.conn().listAllDomains(0)),
            "mdevs": sorted(p.name for p in MDEV_DEVICES.iterdir())}


def test_vm_migrate_moves_a_running_vm_with_its_mdev_to_host_b(hosts: tuple[LabHost, LabHost],
                                                               vm_name: str) -> None:
    import libvirt

    a, b = hosts
    ua = create_on_a(a, vm_name)

    r = migrate(a, vm_name, b)
    assert r.returncode == 0, r.stderr + r.stdout
    print(f"\n[vm migrate] {r.stdout.strip()}")
    json.loads(r.stdout)

    dom = b.domain(vm_name)
    assert dom is not None and dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING
    [ub] = mdev_uuids(dom.XMLDesc(0))
    assert ub != ua and (MDEV_DEVICES / ub).exists()
    assert mdev_uuids(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)) == [ub]
    assert holds(b.qemu_pid(vm_name), group_of(ub))
    assert [(v["uuid"], v["state"]) for v in b.vgpus(vm_name)] == [(ub, "active")]  # made by B's vgpumgr
    assert a.domain(vm_name) is None
    wait_for(f"A's mdev {ua} to be removed", lambda: not (MDEV_DEVICES / ua).exists())
    assert a.vgpus(vm_name) == [] and a.record(ua)["state"] == "released"
    # both audit logs tell the migration: A let the VM and its vGPU go, B took them
    a_events, b_events = a.audit(vm_name), b.audit(vm_name)
    assert any("migrat" in e["action"] for e in a_events), a_events
    assert any("migrat" in e["action"] for e in b_events), b_events
    assert any(e["vgpu"] == ua and e["action"] == "vgpu.remove" for e in a_events)
    assert any(e["vgpu"] == ub for e in b_events)
    assert all(e["outcome"] != "failed" for e in a_events + b_events)
    # QEMU migrated the device's state, not a VM without its device
    assert any("new state STOP_COPY" in line for line in vfio_trace(a.qemu_log(vm_name), ua))
    assert any(line.startswith("vfio_load_state_device_data") for line in vfio_trace(b.qemu_log(vm_name), ub))


def test_vm_migrate_to_a_full_host_b_is_refused_before_it_starts(hosts: tuple[LabHost, LabHost],
                                                                 vm_name: str) -> None:
    a, b = hosts
    ua = create_on_a(a, vm_name, "mtty-2")
    filler = f"{vm_name}-fill"
    try:
        # B takes every mtty-2 left on the one mtty parent (24 ports shared by both hosts' mdevs)
        while b.api("POST", "/v1/vgpus", {"type": "mtty-2", "vm": filler})[0] == 201:
            pass
        assert {t["type"]: t["available_instances"] for t in b.ok("GET", "/v1/types?parent=mtty")} == \
            {"mtty-1": 0, "mtty-2": 0}
        before = both_hosts(a, b, vm_name)
        started = time.monotonic()

        r = migrate(a, vm_name, b)

        assert r.returncode == 4, r.stderr + r.stdout  # conflict: no capacity on the destination
        assert "mtty-2" in r.stderr + r.stdout
        print(f"\n[vm migrate] refused in {time.monotonic() - started:.1f} s: {(r.stderr or r.stdout).strip()}")
        assert both_hosts(a, b, vm_name) == before
        assert holds(a.qemu_pid(vm_name), group_of(ua))
        # refused before it started: QEMU never began a migration, and B never started a QEMU for the VM
        assert not any("PRE_COPY" in line for line in vfio_trace(a.qemu_log(vm_name), ua))
        assert b.qemu_log(vm_name) == ""
    finally:
        for v in b.vgpus(filler):
            b.api("DELETE", f"/v1/vgpus/{v['uuid']}")


def test_vm_migrate_killed_halfway_leaves_the_vm_on_a_and_nothing_on_b(hosts: tuple[LabHost, LabHost],
                                                                       vm_name: str) -> None:
    import libvirt
    import libvirt_qemu

    a, b = hosts
    ua = create_on_a(a, vm_name)
    before = both_hosts(a, b, vm_name)
    dom = a.domain(vm_name)
    # a copy slow enough to abort halfway: every page in full (no zero-page skipping) at 1 MiB/s
    libvirt_qemu.qemuMonitorCommand(
        dom, '{"execute": "migrate-set-parameters", "arguments": {"zero-page-detection": "none"}}', 0)
    dom.migrateSetMaxSpeed(1, 0)
    proc = subprocess.Popen(["lab-host", "a", "vgpumgr", "vm", "migrate", vm_name, "--to", b.uri, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def copying() -> bool:
            stats = a.domain(vm_name).jobStats()
            return stats.get("type") == libvirt.VIR_DOMAIN_JOB_UNBOUNDED and stats.get("memory_processed", 0) > 2 << 20

        wait_for("the migration to copy 2 MiB of RAM", copying, timeout=300)
        dom.abortJob()  # the libvirt job is killed halfway
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out + err

    assert holds(a.qemu_pid(vm_name), group_of(ua))
    assert a.domain(vm_name).state()[0] == libvirt.VIR_DOMAIN_RUNNING
    assert [(v["uuid"], v["state"]) for v in a.vgpus(vm_name)] == [(ua, "active")]
    wait_for(f"{vm_name} to be gone from B", lambda: b.domain(vm_name) is None)
    b.cli_json("reconcile", "--fix")
    assert b.vgpus(vm_name) == []
    after = both_hosts(a, b, vm_name)
    assert after == before, (before, after)
