"""The service works the same on SQLite and on PostgreSQL (a fleet shares one database; rows carry the host)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from vgpumgr.config import Config
from vgpumgr.discovery.mdev import discover_mdevs
from vgpumgr.errors import NoCapacity
from vgpumgr.service import Service
from vgpumgr.sim import profiles


def host_service(tmp_path: Path, db_url: str, name: str, monkeypatch: pytest.MonkeyPatch) -> Service:
    monkeypatch.setenv("VGPUMGR_HOSTNAME", name)
    root = profiles.create(tmp_path / name, "t4")
    cfg = Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / f"{name}-state"), db=db_url,
                         connect="test:///default")
    return Service(cfg, licence_mode="off")


def test_two_hosts_share_one_database(tmp_path: Path, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tag = uuid.uuid4().hex[:8]  # the database is shared by the session's tests
    a = host_service(tmp_path, db_url, f"hv-a-{tag}", monkeypatch)
    b = host_service(tmp_path, db_url, f"hv-b-{tag}", monkeypatch)
    x = a.allocate("T4-16Q", vm=f"vm-{tag}")
    y = b.allocate("T4-16Q", vm=f"vm-{tag}")  # the same GPU address on another host: no conflict
    assert x["parent"] == y["parent"] == "0000:3b:00.0"
    with pytest.raises(NoCapacity):
        a.allocate("T4-1Q")
    assert [r["uuid"] for r in a.allocations(live=True)] == [x["uuid"]]
    assert [r["uuid"] for r in b.allocations(live=True)] == [y["uuid"]]
    a.release(x["uuid"])
    b.release(y["uuid"])
    assert discover_mdevs(a.host) == [] and discover_mdevs(b.host) == []


def test_vm_lifecycle_and_audit_on_each_database(tmp_path: Path, db_url: str, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    from vgpumgr.audit import chain as audit

    tag = uuid.uuid4().hex[:8]
    svc = host_service(tmp_path, db_url, f"hv-{tag}", monkeypatch)
    made = svc.create_vm(f"web-{tag}", vgpus=["T4-4Q"], start=True)
    assert made["state"] == "running"
    svc.delete_vm(f"web-{tag}")
    with svc.sessions() as s:
        actions = [e.action for e in audit.query(s, host=f"hv-{tag}")]
        assert actions[-1] == "vm.undefine" and "vgpu.create" in actions
        assert audit.verify(s).ok
