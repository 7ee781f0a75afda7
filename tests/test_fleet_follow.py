"""A change leaves its host's summary behind and the host's follower sums it after the commit
(vgpumgr.fleet.follow): meanwhile every reader takes that host from its own rows, so answers stay exact; a burst
is summed once; the follower never waits for the host's publish lock; a process's exit and the heartbeat sum
what is left. PostgreSQL (on SQLite a change sums the summary itself)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fleethosts import t4_service
from sqlalchemy import create_engine, text

from vgpumgr.fleet import follow
from vgpumgr.fleet.place import FleetRequest
from vgpumgr.ops import fleet as fleet_ops
from vgpumgr.service import Service

SUMMED = ("SELECT c.short, count(*), sum(CASE WHEN c.free > 0 THEN 1 ELSE 0 END), sum(c.free), sum(c.used), "
          "min(CASE WHEN c.free > 0 THEN g.region_mb - g.used_mb END) FROM fleet_capacity c JOIN fleet_gpus g "
          "ON g.host_id = c.host_id AND g.address = c.gpu WHERE c.host_id = :h GROUP BY c.short")
KEPT = "SELECT short, gpus, open_gpus, free, used, tightest_mb FROM fleet_host_types WHERE host_id = :h"


@pytest.fixture
def pg_url(fresh_db_url: str) -> str:
    if not fresh_db_url.startswith("postgresql"):
        pytest.skip("on SQLite a change sums its host's summary in its own transaction")
    return fresh_db_url


_service = t4_service


def _state(svc: Service) -> tuple[bool, set[tuple[Any, ...]], set[tuple[Any, ...]]]:
    """(the summary marked true for the host's generation, summed from its rows, kept)"""
    h = {"h": svc.host_id(None)}  # type: ignore[arg-type]
    with svc.reads() as s:
        g, t, f = s.execute(text("SELECT generation, types_generation, fit_generation FROM fleet_hosts "
                                 "WHERE host_id = :h"), h).one()
        summed = {tuple(r) for r in s.execute(text(SUMMED), h)}
        kept = {tuple(r) for r in s.execute(text(KEPT), h)}
    return g == t == f, summed, kept


def _slow(monkeypatch: pytest.MonkeyPatch, quiet: float = 60.0, latest: float = 120.0) -> None:
    monkeypatch.setattr(follow, "QUIET_S", quiet)
    monkeypatch.setattr(follow, "LATEST_S", latest)


def test_a_change_leaves_the_summary_behind_and_readers_take_the_hosts_rows(
        tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _slow(monkeypatch)
    svc = _service(tmp_path, pg_url, monkeypatch, "fo-a")
    svc.publish_fleet()
    other = _service(tmp_path, pg_url, monkeypatch, "fo-b")
    other.publish_fleet()
    other.allocate("T4-4Q", vm="x1")  # fo-b's best fit: 12 GB left on a GPU
    svc.allocate("T4-4Q", vm="y1")
    svc.allocate("T4-4Q", vm="y2")  # fo-a: 8 GB left, so `pack` now prefers fo-a, which only its rows say
    true, summed, kept = _state(svc)
    assert not true and summed != kept  # behind: the summary still says what the full publish wrote
    reader = _service(tmp_path, pg_url, monkeypatch, "fo-r", publish="0")
    monkeypatch.setattr(fleet_ops, "EVERY_HOST_UP_TO", 0)  # the large fleet's walk through the summary's index
    for vtype in ("T4-4Q", "T4-8Q", "T4-16Q"):
        req = FleetRequest(vtype)
        full, large = reader.fleet_place(req, every_host=True), reader.fleet_place(req)
        assert large.choice == full.choice and [c.host for c in large.ranked] == [c.host for c in full.ranked]
        assert large.rejected_counts == full.rejected_counts  # fo-a and fo-b counted by their rows
    assert reader.fleet_place(FleetRequest("T4-4Q")).choice.host == "fo-a"
    # hosts whose whole summary awaits its sum are not a rolling upgrade: `pack` keeps its best fit
    monkeypatch.setattr(fleet_ops, "FIT_BEHIND_UP_TO", 0)
    assert "best fit" in reader.fleet_place(FleetRequest("T4-4Q")).choice.why
    by_host = {r["host"]: r for r in reader.fleet_capacity("T4-4Q")["hosts"]}
    assert (by_host["fo-a"]["used"], by_host["fo-b"]["used"]) == (2, 1)
    svc.fleet.follower.settle()
    true, summed, kept = _state(svc)
    assert true and summed == kept


def test_the_follower_sums_a_burst_once_after_it(tmp_path: Path, pg_url: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _slow(monkeypatch, quiet=2.0)
    svc = _service(tmp_path, pg_url, monkeypatch, "fo-c")
    svc.publish_fleet()
    made = [svc.allocate("T4-2Q", vm=f"b{i}")["uuid"] for i in range(3)]
    svc.release(made[0])
    assert not _state(svc)[0] and len(svc.fleet.follower.spent_ms) == 0
    deadline = time.monotonic() + 30
    while not _state(svc)[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    true, summed, kept = _state(svc)
    assert true and summed == kept
    assert len(svc.fleet.follower.spent_ms) == 1  # four changes, one sum


def test_the_follower_never_waits_for_the_hosts_lock(tmp_path: Path, pg_url: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _slow(monkeypatch, quiet=0.05, latest=0.1)
    svc = _service(tmp_path, pg_url, monkeypatch, "fo-d")
    svc.publish_fleet()
    host = {"h": svc.host_id(None)}  # type: ignore[arg-type]
    engine = create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as holder, engine.connect() as probe:
            holder.execute(text("SELECT pg_advisory_xact_lock(1986490485, :h)"), host)
            svc.fleet.follower.due(host["h"])  # as after a change of another process, which holds the lock now
            time.sleep(1.0)
            waiting = probe.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT "
                                         "granted AND objid = :h"), host).scalar()
            probe.rollback()
            assert waiting == 0 and len(svc.fleet.follower.spent_ms) == 0
            holder.rollback()
        deadline = time.monotonic() + 30
        while not svc.fleet.follower.spent_ms and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(svc.fleet.follower.spent_ms) == 1 and _state(svc)[0]
    finally:
        engine.dispose()


def test_the_heartbeat_sums_a_summary_left_behind(tmp_path: Path, pg_url: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed between its change's commit and the sum leaves the host behind: its heartbeat sums it."""
    _slow(monkeypatch)
    svc = _service(tmp_path, pg_url, monkeypatch, "fo-e")
    svc.publish_fleet()
    svc.allocate("T4-8Q", vm="k1")
    assert not _state(svc)[0]
    svc.fleet.follower = None  # as if killed: nothing will sum it
    svc.publish_fleet(heartbeat=True)  # nothing changed since: no GPU's rows written
    true, summed, kept = _state(svc)
    assert true and summed == kept


_CHANGE_AND_EXIT = """
import sys
from vgpumgr.config import Config
from vgpumgr.fleet import follow
from vgpumgr.service import Service
follow.QUIET_S = follow.LATEST_S = 3600.0
svc = Service(Config.resolve(sysfs_root=sys.argv[1], state_dir=sys.argv[2], db=sys.argv[3]), licence_mode="off")
svc.allocate("T4-1Q", vm="exiting")  # its first change writes the GPUs' rows (a full publish)
svc.allocate("T4-1Q", vm="exiting2")  # its second, the one statement: the summary is summed at the exit
"""


def test_a_process_that_ends_sums_at_its_exit(tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = _service(tmp_path, pg_url, monkeypatch, "fo-f")
    svc.publish_fleet()  # its GPUs published: the other process's change is the one statement
    svc.allocate("T4-1Q", vm="first")
    svc.fleet.follower.settle()
    cmd = [sys.executable, "-c", _CHANGE_AND_EXIT, str(tmp_path / "sim-fo-f"), str(tmp_path / "state-fo-f"), pg_url]
    subprocess.run(cmd, check=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    true, summed, kept = _state(svc)
    assert true and summed == kept and any(r[0] == "T4-1Q" and r[4] == 3 for r in kept)
