"""A real VFIO live migration of an mtty mediated device between two libvirt hosts, with vgpumgr on both.

Kernel 6.12's mtty sample driver implements VFIO migration (samples/vfio-mdev/mtty.c: stop-copy, pre-copy and
P2P states), and QEMU 10.0 drives it. Each host's vgpumgr makes its own mdev on the one mtty parent the hosts
share; libvirt migrates the domain peer to peer with the destination's mdev named in the destination XML,
and the project's libvirt hook on each host keeps that host's records: the source's release end releases the
source's mdev, a destination that never got the domain releases its own.

These tests drive libvirt directly (`virDomainMigrateToURI3`), so they prove the kernel, QEMU, libvirt and the
hooks with vgpumgr's records; tests/lab_migration/test_vm_migrate.py does the same through `vgpumgr vm migrate`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
from lab_hosts import MDEV_DEVICES, LabHost, domain_xml, group_of, holds, mdev_uuids, vfio_trace, wait_for

pytestmark = pytest.mark.lab


def migrate_flags() -> int:
    import libvirt

    # live, peer to peer (the source's libvirtd talks to the destination's), persistent there, gone here;
    # never post-copy: QEMU blocks it with a VFIO device
    return (libvirt.VIR_MIGRATE_LIVE | libvirt.VIR_MIGRATE_PEER2PEER | libvirt.VIR_MIGRATE_PERSIST_DEST
            | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE)


def destination_params(dom: Any, source_uuid: str, dest_uuid: str, **extra: Any) -> dict[str, Any]:
    """The domain's live and persistent XML with the destination's mdev in place of the source's."""
    import libvirt

    live = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_MIGRATABLE)
    persistent = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_MIGRATABLE | libvirt.VIR_DOMAIN_XML_INACTIVE)
    assert mdev_uuids(live) == [source_uuid] == mdev_uuids(persistent)
    return {libvirt.VIR_MIGRATE_PARAM_DEST_XML: live.replace(source_uuid, dest_uuid),
            libvirt.VIR_MIGRATE_PARAM_PERSIST_XML: persistent.replace(source_uuid, dest_uuid), **extra}


def running_on(host: LabHost, name: str, uuid: str) -> Any:
    """The domain `name` running on `host` with the mdev `uuid`, whose VFIO group its QEMU holds open."""
    import libvirt

    dom = host.domain(name)
    assert dom is not None, f"{name} is not defined on {host}"
    assert dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING
    assert mdev_uuids(dom.XMLDesc(0)) == [uuid]
    assert holds(host.qemu_pid(name), group_of(uuid)), f"{host}'s QEMU does not hold {uuid}'s VFIO group"
    return dom


def start_on_a(a: LabHost, b: LabHost, name: str) -> tuple[str, str]:
    """(A's mdev, B's mdev) for `name`, each made by that host's vgpumgr; the domain runs on A with A's."""
    ua = a.ok("POST", "/v1/vgpus", {"type": "mtty-1", "vm": name})["uuid"]
    ub = b.ok("POST", "/v1/vgpus", {"type": "mtty-1", "vm": name})["uuid"]
    assert ua != ub  # one kernel: B's vgpumgr sees A's mdev and picks another UUID
    a.conn().defineXML(domain_xml(name, ua)).create()
    running_on(a, name, ua)
    return ua, ub


def test_a_running_mtty_mdev_migrates_live_from_host_a_to_host_b(hosts: tuple[LabHost, LabHost],
                                                                   vm_name: str) -> None:
    import libvirt

    a, b = hosts
    ua, ub = start_on_a(a, b, vm_name)
    dom = a.domain(vm_name)

    started = time.monotonic()
    dom.migrateToURI3(b.uri, destination_params(dom, ua, ub), migrate_flags())
    print(f"\n[migration] {vm_name}: {ua} on lab-a -> {ub} on lab-b in {time.monotonic() - started:.1f} s")

    moved = running_on(b, vm_name, ub)
    assert mdev_uuids(moved.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)) == [ub]  # persistent on B
    assert a.domain(vm_name) is None  # undefined at the source
    # A's release end hook released A's record, which removed A's mdev
    wait_for(f"A's mdev {ua} to be removed", lambda: not (MDEV_DEVICES / ua).exists())
    assert a.record(ua)["state"] == "released"
    assert [v["uuid"] for v in a.vgpus(vm_name)] == []
    assert [(v["uuid"], v["state"]) for v in b.vgpus(vm_name)] == [(ub, "active")]
    removed = [e for e in a.audit(vm_name) if e["action"] == "vgpu.remove" and e["vgpu"] == ua]
    assert [e["actor"] for e in removed] == ["token:lab-hook"]
    assert [e["action"] for e in b.audit(vm_name)] == ["placement", "vgpu.create"]

    # QEMU really migrated the device's state: the source took it through pre-copy and stop-copy, the
    # destination loaded it while RESUMING and then ran it
    source, dest = vfio_trace(a.qemu_log(vm_name), ua), vfio_trace(b.qemu_log(vm_name), ub)
    print("[migration] source QEMU (lab-a):\n  " + "\n  ".join(source))
    print("[migration] destination QEMU (lab-b):\n  " + "\n  ".join(dest))
    states = [line.split("new state ")[1].split(",")[0] for line in source if "new state" in line]
    assert states[-5:] == ["PRE_COPY", "PRE_COPY_P2P", "STOP_COPY", "STOP_COPY", "STOP"], states
    assert any(line.startswith(f"vfio_save_complete_precopy  ({ua}) ret 0") for line in source)
    dest_states = [line.split("new state ")[1].split(",")[0] for line in dest if "new state" in line]
    assert dest_states[-3:] == ["RESUMING", "RUNNING_P2P", "RUNNING"], dest_states
    loaded = [line for line in dest if line.startswith("vfio_load_state_device_data")]
    assert loaded and all(line.endswith("ret 0") for line in loaded)
    assert "shutting down, reason=migrated" in a.qemu_log(vm_name)


def test_an_aborted_migration_leaves_the_domain_on_a_and_nothing_on_b(hosts: tuple[LabHost, LabHost],
                                                                      vm_name: str) -> None:
    import libvirt
    import libvirt_qemu

    a, b = hosts
    ua, ub = start_on_a(a, b, vm_name)
    dom = a.domain(vm_name)
    mdevs_before = {p.name for p in MDEV_DEVICES.iterdir()}
    # Slow the copy down so that the job can be aborted halfway: every page is sent in full (QEMU skips
    # zero pages otherwise, and this guest's RAM is almost all zeros) at 1 MiB/s.
    libvirt_qemu.qemuMonitorCommand(
        dom, '{"execute": "migrate-set-parameters", "arguments": {"zero-page-detection": "none"}}', 0)
    failure: list[Exception] = []

    def migrate() -> None:
        try:
            dom.migrateToURI3(b.uri, destination_params(dom, ua, ub, **{libvirt.VIR_MIGRATE_PARAM_BANDWIDTH: 1}),
                              migrate_flags())
        except libvirt.libvirtError as exc:
            failure.append(exc)

    job = threading.Thread(target=migrate)
    job.start()
    try:
        def copying() -> bool:
            stats = a.domain(vm_name).jobStats()
            return stats.get("type") == libvirt.VIR_DOMAIN_JOB_UNBOUNDED and stats.get("memory_processed", 0) > 2 << 20

        wait_for("the migration to copy 2 MiB of RAM", copying, timeout=300)
        assert b.domain(vm_name) is not None  # B holds the incoming domain, paused
        dom.abortJob()
    finally:
        job.join(timeout=300)
    # The cancel closes the migration stream; libvirt reports whichever side noticed first: the cancel
    # itself or the source's write into the closed stream (seen in CI at 2 MiB of 64 MiB sent at 1 MiB/s,
    # so the migration could not have ended by itself)
    assert failure and any(why in str(failure[0]).lower() for why in ("cancel", "broken pipe")), failure

    running_on(a, vm_name, ua)
    assert a.record(ua)["state"] == "active"
    # B's release end hook released B's mdev when its half-arrived domain went away
    wait_for(f"{vm_name} to be gone from B", lambda: b.domain(vm_name) is None)
    wait_for(f"B's mdev {ub} to be removed", lambda: not (MDEV_DEVICES / ub).exists())
    assert b.record(ub)["state"] == "released"
    fixed = b.cli_json("reconcile", "--fix")
    assert (fixed["missing"], fixed["dead_reservations"], fixed["errors"]) == ([], [], [])
    # what B does not know is A's (one kernel for both hosts): nothing of B's is left
    assert {u["uuid"] for u in fixed["unknown"]} <= mdevs_before - {ub}
    assert b.vgpus(vm_name) == []
    assert {p.name for p in MDEV_DEVICES.iterdir()} == mdevs_before - {ub}
    source_states = [line.split("new state ")[1].split(",")[0] for line in vfio_trace(a.qemu_log(vm_name), ua)
                     if "new state" in line]
    assert "PRE_COPY" in source_states and source_states[-1] == "RUNNING", source_states
    with contextlib.suppress(AssertionError):  # the job's stats after the abort, for the log
        print(f"\n[migration] aborted after {a.domain(vm_name).jobStats(libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED)}")
