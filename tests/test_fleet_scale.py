"""The fleet at scale: each host's per-type summary follows every publish (a full one in its own transaction, a
change once its host's follower sums it), and a
large fleet's answer, read through the summary's index, is the one the placer gives reading every host: the same
choice and ranking, stale and cordoned hosts never chosen, the rest counted; a host running the previous release
(which moves its rows but not its summary) is read from its own rows. On SQLite and PostgreSQL."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fleethosts import board_capacity, publish_synthetic, t4_service
from sqlalchemy import text

from vgpumgr.fleet.place import FleetRequest
from vgpumgr.ops import fleet as fleet_ops
from vgpumgr.service import Service

SUMMARY = ("SELECT c.host_id, c.short, count(*), sum(CASE WHEN c.free > 0 THEN 1 ELSE 0 END), sum(c.free), "
           "sum(c.used), sum(coalesce(c.max, 0)), min(CASE WHEN c.free > 0 THEN g.region_mb - g.used_mb END) "
           "FROM fleet_capacity c JOIN fleet_gpus g ON g.host_id = c.host_id AND g.address = c.gpu "
           "GROUP BY c.host_id, c.short")
KEPT = "SELECT host_id, short, gpus, open_gpus, free, used, max, tightest_mb FROM fleet_host_types"


_service = t4_service


def _summaries(svc: Service) -> tuple[set[tuple[Any, ...]], set[tuple[Any, ...]], list[tuple[int, int]]]:
    """Every host's summary summed from its rows, the summaries kept, and the hosts' marks, once this host's
    summary is summed after its changes (vgpumgr.fleet.follow)."""
    if svc.fleet.follower is not None:
        svc.fleet.follower.settle()
    with svc.reads() as s:
        summed = {tuple(int(x) if isinstance(x, int) else x for x in r) for r in s.execute(text(SUMMARY))}
        kept = {tuple(r) for r in s.execute(text(KEPT))}
        marks = [tuple(r) for r in s.execute(text("SELECT generation, types_generation, fit_generation "
                                                  "FROM fleet_hosts"))]
    return summed, kept, marks


def test_each_hosts_summary_follows_every_publish(tmp_path: Path, fresh_db_url: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "sum-a")
    svc.publish_fleet()
    made = [svc.allocate("T4-4Q", vm=f"web{i}") for i in range(3)]  # the change statement, one GPU each
    made.append(svc.allocate("T4-8Q", vm="big"))
    svc.release(made[0]["uuid"])
    publish_synthetic(fresh_db_url, "sum-b", board_capacity(tmp_path, "t4", scale=2, fill={1: ("T4-2Q", 3)}))
    summed, kept, marks = _summaries(svc)
    assert summed == kept and len(kept) > 20
    assert all(g == t == f for g, t, f in marks)  # every summary and best fit true for its host's generation
    assert any(r[-1] not in (None, 16384) for r in kept)  # a GPU partly used is some host's tightest
    with svc.reads() as s:
        row = s.execute(text("SELECT free, used, open_gpus FROM fleet_host_types t JOIN hosts h ON h.id = t.host_id "
                             "WHERE h.name = 'sum-a' AND t.short = 'T4-4Q'")).one()
    assert tuple(row) == (2, 2, 1)  # one T4 holds two 4Q (2 more fit), the other an 8Q
    for _ in range(10):
        svc.publish_fleet(heartbeat=True)
    assert _summaries(svc)[0] == _summaries(svc)[1]


def _fleet(tmp_path: Path, url: str, n: int, seed: int) -> None:
    t4 = board_capacity(tmp_path, "t4", scale=2)
    rng = random.Random(seed)
    for i in range(n):
        gpus = []
        for g in t4:
            size = rng.choice([t.framebuffer_mb for t in g.types if t.max])
            used = rng.randint(0, 3) if rng.random() < 0.7 else 0
            limit = min(t.max for t in g.types if t.framebuffer_mb == size)
            used = min(used, limit)
            first = next(t.type for t in g.types if t.framebuffer_mb == size)
            types = tuple(replace(t, free=(max(0, t.max - used) if t.framebuffer_mb == size else 0) if used else t.free,
                                  used=used if t.type == first else 0) for t in g.types)
            gpus.append(replace(g, vgpus=used, types=types))
        publish_synthetic(url, f"h{i:02d}", gpus, cordon="test" if i % 7 == 3 else None, stale=i % 9 == 5)


def _names(d: Any) -> list[str]:
    return [c.host for c in d.ranked[:fleet_ops.SHOW_GPUS_OF]]


def test_a_large_fleets_answer_is_the_one_reading_every_host_gives(tmp_path: Path, fresh_db_url: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _fleet(tmp_path, fresh_db_url, 24, seed=5)
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "reader", publish="0")
    monkeypatch.setattr(fleet_ops, "EVERY_HOST_UP_TO", 0)
    monkeypatch.setattr(fleet_ops, "FIRST_BATCH", 2)  # several rounds of the walk
    for vtype in ("T4-4Q", "T4-2Q", "T4-16Q", "T4-1B", "L40S-4Q"):
        for strategy in ("pack", "spread"):
            for count in (1, 2):
                req = FleetRequest(vtype, strategy=strategy, count=count)
                full, large = svc.fleet_place(req, every_host=True), svc.fleet_place(req)
                assert _names(large) == _names(full), (vtype, strategy, count)
                assert large.choice == full.choice and not large.every_host and large.considered == 24
                assert large.rejected_counts == full.rejected_counts
                assert all(c.host not in {"h03", "h10", "h17", "h05", "h14", "h23"} for c in large.ranked)
    req = FleetRequest("T4-4Q", deny_models=("1eb8",))
    full, large = svc.fleet_place(req, every_host=True), svc.fleet_place(req)
    # every host with room read and refused; the others counted by why they have none, before any policy
    fits = {k: n for k, n in full.rejected_counts.items() if k != "model-denied"}
    assert large.choice is None and large.rejected_counts == {**fits, "model-denied": 13, "no-capacity": 5}
    # a host running the previous release moves its rows and its generation, not its summary
    first = svc.fleet_place(FleetRequest("T4-4Q")).choice.host
    with svc.tx() as s:
        s.execute(text("UPDATE fleet_capacity SET free = 0 WHERE short = 'T4-4Q' AND host_id = "
                       "(SELECT id FROM hosts WHERE name = :h)"), {"h": first})
        s.execute(text("UPDATE fleet_hosts SET generation = generation + 1 WHERE host_id = "
                       "(SELECT id FROM hosts WHERE name = :h)"), {"h": first})
    for strategy in ("pack", "spread"):
        req = FleetRequest("T4-4Q", strategy=strategy)
        full, large = svc.fleet_place(req, every_host=True), svc.fleet_place(req)
        assert _names(large) == _names(full) and large.choice == full.choice and large.choice.host != first
        assert large.rejected_counts == full.rejected_counts  # `first` counted by its rows, not its summary
    # the release before this one moves the counts and the GPUs' room and carries its summary's mark on, not the
    # summary's tightest GPU: the host whose GPU has the least room now is `pack`'s choice all the same
    last = svc.fleet_place(FleetRequest("T4-4Q"), every_host=True).ranked[-1].host
    with svc.tx() as s:
        s.execute(text("UPDATE fleet_gpus SET used_mb = region_mb - 1024 WHERE host_id = (SELECT id FROM hosts "
                       "WHERE name = :h) AND address = (SELECT min(c.gpu) FROM fleet_capacity c JOIN hosts n ON "
                       "n.id = c.host_id WHERE n.name = :h AND c.short = 'T4-4Q' AND c.free > 0)"), {"h": last})
        s.execute(text("UPDATE fleet_hosts SET generation = generation + 1, types_generation = CASE WHEN "
                       "types_generation = generation THEN generation + 1 END WHERE host_id = "
                       "(SELECT id FROM hosts WHERE name = :h)"), {"h": last})
    full, large = svc.fleet_place(FleetRequest("T4-4Q"), every_host=True), svc.fleet_place(FleetRequest("T4-4Q"))
    assert full.choice.host == last and full.choice.tightest_mb == 1024
    assert large.choice == full.choice and _names(large) == _names(full)
    # more hosts behind than FIT_BEHIND_UP_TO (a rolling upgrade): `pack` by free instances alone, both ways alike
    monkeypatch.setattr(fleet_ops, "FIT_BEHIND_UP_TO", 0)
    full, large = svc.fleet_place(FleetRequest("T4-4Q"), every_host=True), svc.fleet_place(FleetRequest("T4-4Q"))
    assert large.choice == full.choice and _names(large) == _names(full) and "best fit" not in full.choice.why
    frees = [c.free for c in full.ranked]
    assert frees == sorted(frees) and full.choice.host != last
    # the best host's window passes (its rows and summary untouched), then the next best is cordoned: neither is
    # chosen again, and the counts by reason follow (stale hosts are found by the time their window ends)
    req = FleetRequest("T4-2Q", strategy="spread")
    before = svc.fleet_place(req)
    late = "now() - interval '1 hour'" if svc.cfg.db_url.startswith("postgresql") else \
        "strftime('%Y-%m-%d %H:%M:%f', 'now', '-1 hour')"
    with svc.tx() as s:
        s.execute(text(f"UPDATE fleet_hosts SET heartbeat_at = {late} WHERE host_id = "
                       "(SELECT id FROM hosts WHERE name = :h)"), {"h": before.choice.host})
    svc.cordon_host(before.ranked[1].host, reason="test")
    full, large = svc.fleet_place(req, every_host=True), svc.fleet_place(req)
    assert large.choice == full.choice and _names(large) == _names(full)
    assert large.rejected_counts == full.rejected_counts
    assert large.rejected_counts["stale"] == before.rejected_counts["stale"] + 1
    assert large.rejected_counts["cordoned"] == before.rejected_counts["cordoned"] + 1
    assert {before.choice.host, before.ranked[1].host}.isdisjoint(c.host for c in large.ranked)
    # a VM to move: the walk keeps to its board and vGPU manager in SQL, and ranks as the placer over every host
    mover = _service(tmp_path, fresh_db_url, monkeypatch, "mover")
    mover.publish_fleet()
    mover.allocate("T4-4Q", vm="moving")
    for strategy in ("pack", "spread"):
        req = FleetRequest("T4-4Q", vm="moving", strategy=strategy)
        full, large = svc.fleet_place(req, every_host=True), svc.fleet_place(req)
        assert large.choice is not None and large.choice == full.choice and _names(large) == _names(full)
        assert large.migrating is not None and large.migrating.host == "mover" and large.choice.host != "mover"


def test_the_fleet_page_is_chosen_and_counted_in_sql(tmp_path: Path, fresh_db_url: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _fleet(tmp_path, fresh_db_url, 12, seed=9)
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "reader", publish="0")
    g = svc.fleet_grid(page=2, per_page=5)
    assert [h["host"] for h in g["hosts"]] == ["h05", "h06", "h07", "h08", "h09"] and g["pages"] == 3
    assert g["counts"] == {"hosts": 12, "ok": 9, "stale": 1, "cordoned": 2, "gpus": 24,
                           "vgpus": sum(h["vgpus"] for h in svc.fleet_hosts())}
    assert [h["host"] for h in svc.fleet_grid(state="stale")["hosts"]] == ["h05"]
    assert [h["host"] for h in svc.fleet_grid(state="cordoned")["hosts"]] == ["h03", "h10"]
    assert svc.fleet_grid(type_name="L40S-4Q")["matching"] == 0
    t4 = svc.fleet_grid(type_name="T4-4Q", state="ok")
    assert t4["matching"] == 9 and t4["placeable_free"] == svc.fleet_capacity("T4-4Q")["free"]
    # a host on the previous release (its summary behind its generation) is found by its own rows
    with svc.tx() as s:
        s.execute(text("UPDATE fleet_host_types SET short = 'gone' WHERE short = 'T4-4Q' AND host_id = "
                       "(SELECT id FROM hosts WHERE name = 'h00')"))
        s.execute(text("UPDATE fleet_hosts SET generation = generation + 1 WHERE host_id = "
                       "(SELECT id FROM hosts WHERE name = 'h00')"))
    assert svc.fleet_grid(type_name="T4-4Q", state="ok")["matching"] == 9
