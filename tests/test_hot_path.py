"""The trimmed allocation path keeps its meaning: what it no longer re-reads, it still knows right.

No timings here (the benchmarks under scripts/ measure); these check behaviour: the snapshot after our own
change equals a fresh scan, lookups take no SQLite write lock, a second release of one vGPU changes nothing,
a dead reservation found inside the placement transaction is rolled back before allocating, and
--print-xml compiles the schema only when asked.
"""

from __future__ import annotations

import io
import os
import uuid as uuidlib
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select

from vgpumgr import ids
from vgpumgr.audit import chain as audit
from vgpumgr.config import Config
from vgpumgr.db import store
from vgpumgr.db.models import Allocation
from vgpumgr.discovery.inventory import scan
from vgpumgr.errors import NotFound
from vgpumgr.service import Service
from vgpumgr.sim import profiles


def make_service(tmp_path: Path, profile: str = "mixed", **kw: Any) -> Service:
    root = profiles.create(tmp_path / "sim", profile, **kw)
    cfg = Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "state"), connect="test:///default")
    return Service(cfg, licence_mode="off")


def _view(inv: Any) -> tuple[Any, ...]:
    return (sorted((t.parent, t.type, t.available_instances) for t in inv.types),
            [(m.uuid, m.parent, m.type, m.gpu, m.iommu_group) for m in inv.mdevs],
            [(v.address, v.type, v.name, v.gpu) for v in inv.vf_vgpus])


@pytest.mark.parametrize("profile, type_name", [("mixed", "T4-4Q"), ("t4", "T4-2Q"), ("a40-sriov", "A40-4Q")])
def test_snapshot_after_own_changes_equals_a_fresh_scan(tmp_path: Path, profile: str, type_name: str) -> None:
    svc = make_service(tmp_path, profile)
    made = [svc.allocate(type_name, vm=f"vm{i}") for i in range(3)]
    assert _view(svc.snapshot().inventory) == _view(scan(svc.host))
    svc.release(made[1]["uuid"] or made[1]["pci_address"])
    assert _view(svc.snapshot().inventory) == _view(scan(svc.host))
    assert len(svc.snapshot().inventory.mdevs) + len(svc.snapshot().inventory.vf_vgpus) == 2


def test_snapshot_after_own_vendor_vf_changes_equals_a_fresh_scan(tmp_path: Path) -> None:
    """Vendor VFs: the touched GPU's VFs are found through its virtfn links, and their vGPUs' type names
    (no longer in the VF's creatable list once set) gathered only then."""
    svc = make_service(tmp_path, "l40s-vfio", vfs=4)
    made = [svc.allocate("L40S-4Q", vm=f"vm{i}") for i in range(3)]
    assert _view(svc.snapshot().inventory) == _view(scan(svc.host))
    assert {v.name for v in svc.snapshot().inventory.vf_vgpus} == {"NVIDIA L40S-4Q"}
    svc.release(made[1]["pci_address"])
    assert _view(svc.snapshot().inventory) == _view(scan(svc.host))
    assert len(svc.snapshot().inventory.vf_vgpus) == 2


def test_lookups_take_no_sqlite_write_lock(tmp_path: Path) -> None:
    svc = make_service(tmp_path)
    begins: list[str] = []
    engine = svc.sessions.kw["bind"]
    # the BEGIN goes to the driver connection directly: watch what SQLite itself is asked to run
    event.listen(engine, "connect", lambda dbapi_conn, _rec: dbapi_conn.set_trace_callback(
        lambda sql: begins.append(sql) if sql.startswith("BEGIN") else None))
    engine.dispose()  # new connections, with the trace
    a = svc.allocate("T4-4Q", vm="web1")
    begins.clear()
    assert svc.find_allocation(a["uuid"])["vm"] == "web1"
    assert begins == ["BEGIN"]
    begins.clear()
    svc.release(a["uuid"])
    assert begins == ["BEGIN", "BEGIN IMMEDIATE"]  # the lookup, then the release's record


def test_a_second_release_of_the_same_row_changes_nothing(tmp_path: Path) -> None:
    svc = make_service(tmp_path)
    a = svc.allocate("T4-4Q", vm="web1")
    with svc.reads() as s:
        found = store.live_allocation_row(s, svc.host_id(s), uuid=a["uuid"])
    first, second = store.detached(found), store.detached(found)  # two callers that read it while live
    with svc.tx() as s:
        assert store.release_live(s, first) is True
    with svc.tx() as s:
        assert store.release_live(s, second) is False
    assert (first.state, second.state) == ("released", "active")
    with svc.reads() as s:
        assert s.scalar(select(Allocation.state).where(Allocation.id == a["id"])) == "released"
    with pytest.raises(NotFound):
        svc.release(a["uuid"])


def test_dead_reservation_found_in_the_placement_transaction_is_rolled_back_first(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "t4")
    with svc.reads() as s:
        host_id = svc.host_id(s)
    dead_uuid = ids.new_uuid()
    with svc.tx() as s:  # a reservation whose owner (a pid of another boot) is gone
        store.reserve_allocation(s, host_id, backend="mdev", parent="0000:3b:00.0", type_id="nvidia-232",
                                 uuid=dead_uuid, detail={"gpu": "0000:3b:00.0", "framebuffer_mb": 4096},
                                 owner={"owner_host": svc.hostname, "owner_boot": "not-this-boot",
                                        "owner_pid": os.getpid(), "owner_started": 1,
                                        "lease_until": None})
    a = svc.allocate("T4-4Q", vm="web1")
    assert a["state"] == "active"
    with svc.reads() as s:
        assert s.scalar(select(Allocation.state).where(Allocation.uuid == dead_uuid)) == "released"
        actions = [e.action for e in audit.query(s)]
    assert actions.index("vgpu.rollback") < actions.index("vgpu.create")


def test_new_uuid_is_a_random_version_4_uuid() -> None:
    seen = {ids.new_uuid() for _ in range(200)}
    assert len(seen) == 200
    for u in seen:
        parsed = uuidlib.UUID(u)
        assert str(parsed) == u and parsed.version == 4 and parsed.variant == uuidlib.RFC_4122


def test_print_xml_compiles_the_schema_only_when_asked(tmp_path: Path) -> None:
    from vgpumgr.cli.main import main
    from vgpumgr.virt import domain

    root = profiles.create(tmp_path / "sim", "t4")
    domain._domain_rng.cache_clear()
    argv = ["--sysfs-root", str(root), "vm", "create", "dry", "--vgpu", "T4-4Q", "--print-xml"]
    out = io.StringIO()
    assert main(argv, out=out) == 0 and "<hostdev" in out.getvalue()
    assert domain._domain_rng.cache_info().misses == 0
    assert main([*argv, "--validate"], out=io.StringIO()) == 0
    assert domain._domain_rng.cache_info().misses == 1
