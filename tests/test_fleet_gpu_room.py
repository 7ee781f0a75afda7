"""Each published GPU's room on its own row (fleet_gpus.region_mb, used_mb; migration 0017): what its type rows
sum to after every kind of publish, on SQLite and PostgreSQL; and a GPU whose room a previous release left
behind is read from its type rows instead."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import text

from vgpumgr.config import Config
from vgpumgr.fleet import fragmented
from vgpumgr.placement.placer import Policy
from vgpumgr.service import Service
from vgpumgr.sim import profiles

T4, T4_B = "0000:3b:00.0", "0000:3d:00.0"
# each GPU's room as published, and as its type rows sum it
_ROOMS = text(
    "SELECT g.address, g.region_mb, g.used_mb, g.room_at = g.published_at, "
    "(SELECT max(c.framebuffer_mb) FROM fleet_capacity c WHERE c.host_id = g.host_id AND c.gpu = g.address), "
    "(SELECT sum(c.used * coalesce(c.framebuffer_mb, 0)) FROM fleet_capacity c WHERE c.host_id = g.host_id "
    "AND c.gpu = g.address) FROM fleet_gpus g JOIN hosts h ON h.id = g.host_id WHERE h.name = :h "
    "ORDER BY g.address")


def _service(tmp_path: Path, db_url: str, monkeypatch: pytest.MonkeyPatch, name: str) -> Service:
    monkeypatch.setenv("VGPUMGR_HOSTNAME", name)
    if "VGPUMGR_FLEET_PUBLISH" not in os.environ:
        monkeypatch.setenv("VGPUMGR_FLEET_PUBLISH", "1")  # every change, on SQLite too
    root = profiles.create(tmp_path / f"sim-{name}", "t4", scale=2)
    return Service(Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / f"state-{name}"), db=db_url),
                   licence_mode="off")


def _rooms(svc: Service) -> dict[str, tuple[int | None, int | None]]:
    """GPU -> (region MB, used MB) as published, checked against its type rows."""
    with svc.reads() as s:
        rows = s.execute(_ROOMS, {"h": svc.hostname}).all()
    assert rows
    for gpu, region, used, current, summed_region, summed_used in rows:
        assert (region, used) == (summed_region, summed_used or 0), gpu
        assert current, f"{gpu}: room_at is not its published_at"
    return {r[0]: (r[1], r[2]) for r in rows}


def test_each_gpu_publishes_the_room_its_type_rows_sum_to(tmp_path: Path, fresh_db_url: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "room-a")
    svc.publish_fleet()
    assert _rooms(svc) == {T4: (16384, 0), T4_B: (16384, 0)}
    a = svc.allocate("T4-4Q", vm="web1", policy=Policy(pin_gpu=T4))  # a change of one GPU: the change statement
    b = svc.allocate("T4-4Q", vm="web2", policy=Policy(pin_gpu=T4))
    assert _rooms(svc)[T4] == (16384, 8192)
    svc.release(a["uuid"])
    assert _rooms(svc) == {T4: (16384, 4096), T4_B: (16384, 0)}
    svc.allocate("T4-8Q", vm="web3", policy=Policy(pin_gpu=T4_B))
    svc.release(b["uuid"])
    assert svc.publish_fleet()["gpus_written"] == 2  # a full publish rewrites every row
    assert _rooms(svc) == {T4: (16384, 0), T4_B: (16384, 8192)}


def test_a_gpu_whose_room_a_previous_release_left_behind_is_summed_from_its_rows(
        tmp_path: Path, fresh_db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "room-b")
    svc.allocate("T4-2Q", vm="web1", policy=Policy(pin_gpu=T4))
    svc.publish_fleet()
    with svc.tx() as s:
        host_id = s.execute(text("SELECT id FROM hosts WHERE name = :h"), {"h": svc.hostname}).scalar_one()
        assert [r.gpu for r in fragmented.rooms(s, [host_id], 8192)] == [T4]  # 14 GB free, holding one
        # the previous release's change: vGPUs and published_at moved, the room left as it was
        s.execute(text("UPDATE fleet_gpus SET used_mb = 16384, published_at = :t WHERE host_id = :h AND "
                       "address = :g"), {"t": "2030-01-01 00:00:00", "h": host_id, "g": T4})
    with svc.reads() as s:
        assert fragmented.rooms(s, [host_id], 8192) == [fragmented.Room(host_id, T4, 16384, 2048)]
        assert fragmented.rooms(s, [host_id], 16384) == []


def test_a_large_fleets_hint_walks_the_gpus_with_the_most_room_on_hosts_without_a_free_instance(
        tmp_path: Path, fresh_db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "room-c")
    svc.allocate("T4-2Q", vm="web1", policy=Policy(pin_gpu=T4))  # 14 GB free
    svc.allocate("T4-1Q", vm="web2", policy=Policy(pin_gpu=T4_B))  # 15 GB free: no T4-8Q free on this host
    svc.publish_fleet()
    with svc.reads() as s:
        host_id = s.execute(text("SELECT id FROM hosts WHERE name = :h"), {"h": svc.hostname}).scalar_one()
        rooms, names = fragmented.roomiest(s, "T4-8Q", 2)
        assert [(r.gpu, r.region_mb - r.used_mb) for r in rooms] == [(T4_B, 15360), (T4, 14336)]
        assert names == {host_id: svc.hostname}
        assert [r.gpu for r in fragmented.roomiest(s, "T4-8Q", 1)[0]] == [T4_B]  # the most room first
        assert fragmented.roomiest(s, "T4-2Q", 2)[0] == []  # a free instance on the host: it has room
        assert fragmented.roomiest(s, "T4-16Q", 2)[0] == []  # no GPU has 16 GB free
    svc.cordon_host(svc.hostname, reason="maintenance")
    with svc.reads() as s:
        assert fragmented.roomiest(s, "T4-8Q", 2)[0] == []  # a cordoned host is never named
