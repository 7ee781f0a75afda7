"""What a host publishes and when: with every change in that change's own transaction (or not at all), on a
heartbeat, never blocking a change it cannot compute, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from vgpumgr.config import Config
from vgpumgr.errors import InvalidInput
from vgpumgr.fleet import publish
from vgpumgr.fleet.place import FleetRequest
from vgpumgr.service import Service
from vgpumgr.sim import profiles

T4 = "0000:3b:00.0"


def _service(tmp_path: Path, db_url: str, monkeypatch: pytest.MonkeyPatch, name: str, profile: str = "t4",
             **kw: object) -> Service:
    monkeypatch.setenv("VGPUMGR_HOSTNAME", name)
    if "VGPUMGR_FLEET_PUBLISH" not in os.environ:
        monkeypatch.setenv("VGPUMGR_FLEET_PUBLISH", "1")  # every change, on SQLite too
    root = profiles.create(tmp_path / f"sim-{name}", profile, **kw)
    return Service(Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / f"state-{name}"), db=db_url),
                   licence_mode="off")


def _row(svc: Service, gpu: str, short: str) -> tuple[int, int] | None:
    with svc.reads() as s:
        r = s.execute(text("SELECT c.free, c.used FROM fleet_capacity c JOIN hosts h ON h.id = c.host_id "
                           "WHERE h.name = :h AND c.gpu = :g AND c.short = :t"),
                      {"h": svc.hostname, "g": gpu, "t": short}).first()
    return tuple(r) if r else None


def _settled(svc: Service) -> None:
    """The host's summary summed now where a change left it behind (its follower would, 50 ms after the change)."""
    if svc.fleet.follower is not None:
        svc.fleet.follower.settle()


def _marks(svc: Service) -> tuple[int, int | None, int | None]:
    with svc.reads() as s:
        return tuple(s.execute(text("SELECT generation, types_generation, fit_generation FROM fleet_hosts "
                                    "WHERE host_id = :h"), {"h": svc.host_id(None)}).one())  # type: ignore[arg-type]


def _generation(svc: Service) -> int | None:
    with svc.reads() as s:
        return s.execute(text("SELECT generation FROM fleet_hosts f JOIN hosts h ON h.id = f.host_id "
                              "WHERE h.name = :h"), {"h": svc.hostname}).scalar()


def test_each_change_publishes_its_gpu_in_its_own_transaction(tmp_path: Path, fresh_db_url: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "pub-a", scale=2)
    assert _row(svc, T4, "T4-4Q") is None  # nothing published before the first change or heartbeat
    a = svc.allocate("T4-4Q", vm="web1")
    assert _row(svc, T4, "T4-4Q") == (3, 1) and _row(svc, T4, "T4-8Q") == (0, 0)
    assert _row(svc, "0000:3d:00.0", "T4-4Q") is None  # only the touched GPU: the other waits for a heartbeat
    generation = _generation(svc)
    svc.release(a["uuid"])
    assert _row(svc, T4, "T4-4Q") == (4, 0) and _generation(svc) == generation + 1
    # the rows commit with the change's audit event, or not at all
    svc.allocate("T4-4Q", vm="web2")
    with pytest.raises(RuntimeError), svc.tx() as s:
        svc.touch(T4, T4)
        svc.host.write(svc.host.mdev_type(T4, "nvidia-232") / "create", "0f3c1e56-2b9e-4d67-9a8f-5a1c2b3d4e5f")
        svc.invalidate()
        svc.event(s, "test.change")
        assert svc.fleet._written  # written in the transaction...
        raise RuntimeError("the change fails after its event")
    assert _row(svc, T4, "T4-4Q") == (3, 1)  # ...and rolled back with it
    assert svc.fleet.wanted  # so the next publish writes it again
    assert svc.publish_fleet()["gpus_written"] == 2
    assert _row(svc, T4, "T4-4Q") == (2, 2) and _row(svc, "0000:3d:00.0", "T4-4Q") == (4, 0)


def test_a_change_goes_on_when_its_capacity_cannot_be_computed(tmp_path: Path, fresh_db_url: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "pub-b")
    svc.publish_fleet()

    def broken(*_: object, **__: object) -> None:
        raise ValueError("no capacity today")

    monkeypatch.setattr(publish, "host_capacity", broken)
    made = svc.allocate("T4-4Q", vm="web1")
    assert made["state"] == "active" and _row(svc, T4, "T4-4Q") == (4, 0)  # the old rows stay...
    monkeypatch.undo()
    assert svc.fleet.wanted  # ...and the whole host is published with the next change
    svc.release(made["uuid"])
    assert _row(svc, T4, "T4-4Q") == (4, 0) and _generation(svc) == 2


def test_the_heartbeat_writes_only_what_changed_and_everything_every_tenth_time(
        tmp_path: Path, fresh_db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "pub-c", scale=3)
    assert svc.publish_fleet(heartbeat=True)["gpus_written"] == 3  # the first beat: everything
    written = [svc.publish_fleet(heartbeat=True)["gpus_written"] for _ in range(9)]
    assert written == [0] * 9
    assert svc.publish_fleet(heartbeat=True)["gpus_written"] == 3  # the tenth after the first
    from vgpumgr.backends import mdev as mdev_backend

    mdev_backend.create(svc.host, T4, "nvidia-232", None)  # behind vgpumgr's back
    assert svc.publish_fleet(heartbeat=True)["gpus_written"] == 1 and _row(svc, T4, "T4-4Q") == (3, 1)
    hosts = svc.fleet_hosts()
    assert [h["host"] for h in hosts] == ["pub-c"] and hosts[0]["gpus"] == 3 and hosts[0]["vgpus"] == 1
    assert hosts[0]["generation"] == 12 and not hosts[0]["stale"]


def test_after_a_udev_event_a_change_writes_only_what_changed(tmp_path: Path, fresh_db_url: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """udev reports every mdev this host makes or removes (api/watch.py calls `invalidate()`): the next change
    compares the whole host with what it last wrote instead of rewriting every row (15-20 ms a change on a T4
    host), and rewrites it all only where its GPUs are not those it wrote."""
    from vgpumgr.fleet import writes

    svc = _service(tmp_path, fresh_db_url, monkeypatch, "pub-u", scale=3)
    svc.publish_fleet()
    gpus = sorted(g.address for g in svc.snapshot().inventory.gpus if not g.is_vf)
    assert len(gpus) == 3 and gpus[0] == T4
    calls: list[tuple[str, list[str]]] = []
    kinds: list[str] = []
    for name in ("write_gpus", "prune_gpus", "write_counts"):
        def spy(*a: Any, _name: str = name, _inner: Any = getattr(writes, name), **k: Any) -> Any:
            written = a[2] if len(a) > 2 else []  # GpuCapacity rows, or prune_gpus' addresses
            calls.append((_name, sorted(getattr(g, "address", g) for g in written)))
            return _inner(*a, **k)
        monkeypatch.setattr(writes, name, spy)
    svc.fleet.observe = lambda _s, kind: kinds.append(kind)

    def rows() -> list[tuple[Any, ...]]:
        with svc.reads() as s:
            return [tuple(r) for r in s.execute(text(
                "SELECT c.gpu, c.type_id, c.free, c.used, c.max FROM fleet_capacity c JOIN hosts h ON h.id = c.host_id "
                "WHERE h.name = :h ORDER BY 1, 2"), {"h": svc.hostname})]

    svc.invalidate()  # as udev does
    a = svc.allocate("T4-4Q", vm="web1")
    assert {c for c, _ in calls} == {"write_counts"} and {g for _, gpus in calls for g in gpus} == {T4}
    assert set(kinds) == {"change"}
    assert _row(svc, T4, "T4-4Q") == (3, 1) and _row(svc, gpus[1], "T4-4Q") == (4, 0)
    after_change = rows()
    calls.clear()
    svc.publish_fleet()  # every row rewritten: the same rows
    assert ("prune_gpus", gpus) in calls and rows() == after_change
    calls.clear()
    kinds.clear()
    svc.fleet._written.pop(gpus[2])  # a GPU this process has not written (as after its first start)
    svc.invalidate()
    svc.release(a["uuid"])
    assert ("prune_gpus", gpus) in calls and "full" in kinds
    assert _row(svc, T4, "T4-4Q") == (4, 0)


def test_publishing_off_and_bad_settings(tmp_path: Path, fresh_db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPUMGR_FLEET_PUBLISH", "0")
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "pub-d")
    svc.allocate("T4-4Q")
    assert svc.publish_fleet()["gpus_written"] == 0 and svc.fleet_hosts() == []
    monkeypatch.setenv("VGPUMGR_FLEET_PUBLISH", "1")
    monkeypatch.setenv("VGPUMGR_FLEET_STALE_FACTOR", "0.5")
    with pytest.raises(InvalidInput, match="VGPUMGR_FLEET_STALE_FACTOR"):
        _service(tmp_path, fresh_db_url, monkeypatch, "pub-e")
    monkeypatch.setenv("VGPUMGR_FLEET_STALE_FACTOR", "4")
    monkeypatch.setenv("VGPUMGR_FLEET_HEARTBEAT", "-1")
    with pytest.raises(InvalidInput, match="VGPUMGR_FLEET_HEARTBEAT"):
        _service(tmp_path, fresh_db_url, monkeypatch, "pub-f")
    monkeypatch.setenv("VGPUMGR_FLEET_HEARTBEAT", "10")
    monkeypatch.setenv("VGPUMGR_MIGRATION_URI", "qemu+tls://gpu-g.example/system")
    g = _service(tmp_path, fresh_db_url, monkeypatch, "pub-g")
    g.publish_fleet()
    (h,) = g.fleet_hosts()
    assert (h["heartbeat_s"], h["stale_after_s"], h["migration_uri"]) == (10.0, 40.0, "qemu+tls://gpu-g.example/system")


def test_a_host_that_stops_beating_goes_stale_and_is_not_chosen(tmp_path: Path, fresh_db_url: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPUMGR_FLEET_HEARTBEAT", "0.2")
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "pub-h")
    svc.publish_fleet()
    assert svc.fleet_place(FleetRequest("T4-4Q")).choice.host == "pub-h"
    import time

    time.sleep(0.8)  # past 0.2 s x 3
    d = svc.fleet_place(FleetRequest("T4-4Q"))
    assert d.choice is None and d.rejected[0].code == "stale"
    svc.publish_fleet()
    assert svc.fleet_place(FleetRequest("T4-4Q")).choice.host == "pub-h"


def test_mig_and_vendor_vf_gpus_publish_their_mode_and_driver(tmp_path: Path, fresh_db_url: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "pub-i", "mixed", vfs=4)
    svc.publish_fleet()
    gpus = {g["address"]: g for g in svc.fleet_gpus()}
    assert {a: g["mode"] for a, g in gpus.items()} == {"0000:00:02.0": "mdev", T4: "mdev",
                                                       "0000:3d:00.0": "nvidia-vf", "0000:65:00.0": "mig"}
    assert gpus["0000:3d:00.0"]["driver_version"] == "580.159.04" and gpus["0000:00:02.0"]["driver_version"] is None
    svc.allocate_mig("1g.10gb", vm="ml1")  # a GPU instance made and bound: published with the change
    mig = {g["type"]: g for g in svc.fleet_gpus(type_name="A100D-1-10C")}
    assert mig["GRID A100D-1-10C"]["used"] == 1 and mig["GRID A100D-1-10C"]["free"] == 3  # 4 VFs: one per vGPU


def test_each_change_publishes_by_default_on_postgresql_and_only_the_heartbeat_on_sqlite(
        tmp_path: Path, fresh_db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPUMGR_FLEET_PUBLISH", "")
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "pub-j")
    svc.publish_fleet()
    svc.allocate("T4-4Q", vm="web1")
    shared = fresh_db_url.startswith("postgresql")
    assert svc.fleet.per_change is shared
    assert _row(svc, T4, "T4-4Q") == ((3, 1) if shared else (4, 0))
    svc.publish_fleet()
    assert _row(svc, T4, "T4-4Q") == (3, 1)


def test_a_full_publish_and_a_change_of_one_host_at_once_do_not_deadlock(
        tmp_path: Path, fresh_db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes of one host (the service, a hook or the CLI) publish into the same rows in two orders: a full
    publish the GPU row, then the capacity rows; a change the capacity rows, then the GPU row. Held apart only by
    the host lock before (CI once saw the deadlock); here the full publish is stopped between the two while the
    change runs."""
    import threading

    from vgpumgr.fleet import writes

    if not fresh_db_url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time")
    full = _service(tmp_path, fresh_db_url, monkeypatch, "pub-k")
    change = Service(full.cfg, licence_mode="off")  # a second process of the same host
    full.publish_fleet()
    change.publish_fleet()  # it has written the GPU: its next publish of it is a change (one statement)
    full.host.write(full.host.mdev_type(T4, "nvidia-232") / "create", "6a0e4c1d-3b5f-4e8a-9c2d-7f1b0a9e8d7c")
    for svc in (full, change):  # both now publish new counts of the GPU: both write the same rows
        svc.snapshot(refresh=True)
    midway, go, errors = threading.Event(), threading.Event(), []
    run_sql = writes._run

    def paused(s: object, name: str, *a: object, **kw: object) -> None:
        if threading.current_thread().name == "full" and name == "capacity":  # the GPU row written, not these
            midway.set()
            go.wait(10)
        run_sql(s, name, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(writes, "_run", paused)

    def run(svc: Service, is_full: bool) -> None:
        try:
            with svc.tx() as s:
                svc.fleet.mark(T4)
                svc.fleet.publish(s, full=is_full)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    a = threading.Thread(target=run, args=(full, True), name="full")
    a.start()
    assert midway.wait(10)
    b = threading.Thread(target=run, args=(change, False), name="change")
    b.start()
    b.join(2)  # the change now waits for the full publish (without the publish lock: for its rows)
    go.set()
    a.join(30)
    b.join(30)
    assert not a.is_alive() and not b.is_alive()
    assert errors == []


def test_a_change_takes_its_hosts_publish_lock_before_it_locks_a_row(
        tmp_path: Path, fresh_db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A change sends the host's publish lock and its statement together (one round trip, vgpumgr.fleet.writes):
    while another transaction holds the lock, the waiting change holds none of the host's fleet rows."""
    import threading

    from sqlalchemy import create_engine

    if not fresh_db_url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time")
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "pub-l")
    svc.publish_fleet()
    svc.allocate("T4-4Q", vm="web1")  # the GPU is published: its next change is the one statement
    host = {"h": svc.host_id(None)}  # type: ignore[arg-type]
    engine = create_engine(fresh_db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    done: list[object] = []
    try:
        with engine.connect() as holder, engine.connect() as probe:
            holder.execute(text("SELECT pg_advisory_xact_lock(1986490485, :h)"), host)
            change = threading.Thread(target=lambda: done.append(svc.allocate("T4-4Q", vm="web2")))
            change.start()
            _wait_for_the_lock(probe, host)
            for table in ("fleet_capacity", "fleet_gpus", "fleet_host_types", "fleet_hosts"):
                probe.execute(text(f"SELECT 1 FROM {table} WHERE host_id = :h FOR UPDATE NOWAIT"), host)
            probe.rollback()
            holder.rollback()
            change.join(30)
        assert not change.is_alive() and len(done) == 1
        assert _row(svc, T4, "T4-4Q") == (2, 2)
    finally:
        engine.dispose()


def test_a_change_that_waited_for_its_hosts_lock_reads_what_the_holder_wrote(
        tmp_path: Path, fresh_db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The change statement's snapshot is older than the lock it waited for: a row the holder changed, which the
    change would leave alone by its old value, is still read at its newest and set right, with the summary."""

    from sqlalchemy import create_engine

    if not fresh_db_url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time")
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "pub-n")
    svc.publish_fleet()
    svc.allocate("T4-4Q", vm="web1")  # equal-size mode: T4-8Q has no room on the GPU, before and after web2
    host = {"h": svc.host_id(None), "g": T4}  # type: ignore[arg-type]
    engine = create_engine(fresh_db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as holder, engine.connect() as probe:
            holder.execute(text("SELECT pg_advisory_xact_lock(1986490485, :h)"), host)
            holder.execute(text("UPDATE fleet_capacity SET free = 5 WHERE host_id = :h AND gpu = :g "
                                "AND short = 'T4-8Q'"), host)  # another publish's (wrong) view, with its summary
            holder.execute(text("UPDATE fleet_host_types SET free = free + 5, open_gpus = open_gpus + 1 "
                                "WHERE host_id = :h AND short = 'T4-8Q'"), host)
            _allocate_while_held(svc, holder, probe, host)
        assert _row(svc, T4, "T4-8Q") == (0, 0) and _row(svc, T4, "T4-4Q") == (2, 2)
        _settled(svc)
        with svc.reads() as s:
            summary = s.execute(text("SELECT free, open_gpus FROM fleet_host_types WHERE host_id = :h "
                                     "AND short = 'T4-8Q'"), host).one()
            rows = s.execute(text("SELECT sum(free), sum(CASE WHEN free > 0 THEN 1 ELSE 0 END) FROM fleet_capacity "
                                  "WHERE host_id = :h AND short = 'T4-8Q'"), host).one()
        assert tuple(summary) == tuple(rows)
        generation, types_generation, fit_generation = _marks(svc)
        assert generation == types_generation == fit_generation
    finally:
        engine.dispose()


_TIGHTEST = ("SELECT c.short, min(CASE WHEN c.free > 0 THEN g.region_mb - g.used_mb END) FROM fleet_capacity c "
             "JOIN fleet_gpus g ON g.host_id = c.host_id AND g.address = c.gpu WHERE c.host_id = :h GROUP BY c.short")


def test_a_change_that_waited_for_its_hosts_lock_is_summed_with_what_the_holder_wrote(
        tmp_path: Path, fresh_db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where another publish of the host committed while the change waited for the lock (another GPU filled up),
    the summary summed after the change has both: each type's tightest GPU true, and marked true."""

    from sqlalchemy import create_engine

    if not fresh_db_url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time")
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "pub-f", scale=2)
    svc.publish_fleet()
    svc.allocate("T4-4Q", vm="web1")
    host = {"h": svc.host_id(None), "g": T4}  # type: ignore[arg-type]
    engine = create_engine(fresh_db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as holder, engine.connect() as probe:
            other = holder.execute(text("SELECT min(address) FROM fleet_gpus WHERE host_id = :h AND address <> :g"),
                                   host).scalar()
            holder.execute(text("SELECT pg_advisory_xact_lock(1986490485, :h)"), host)
            # another process's publish: a 2Q on the other GPU, its room and its summary's counts, one generation on
            holder.execute(text("UPDATE fleet_gpus SET vgpus = 1, used_mb = 2048 WHERE host_id = :h AND address = :o"),
                           {**host, "o": other})
            holder.execute(text("UPDATE fleet_hosts SET generation = generation + 1, types_generation = "
                                "types_generation + 1, fit_generation = fit_generation + 1 WHERE host_id = :h"), host)
            _allocate_while_held(svc, holder, probe, host)
        _settled(svc)
        with svc.reads() as s:
            kept = dict(s.execute(text("SELECT short, tightest_mb FROM fleet_host_types WHERE host_id = :h"), host)
                        .all())
            fresh = dict(s.execute(text(_TIGHTEST), host).all())
            marks = s.execute(text("SELECT generation, fit_generation FROM fleet_hosts WHERE host_id = :h"),
                              host).one()
        assert kept == fresh and kept["T4-2Q"] == 16384 - 2048 and kept["T4-4Q"] == 16384 - 2 * 4096
        assert marks[0] == marks[1]
    finally:
        engine.dispose()


def test_a_host_whose_best_fit_is_not_true_takes_it_afresh_after_its_next_change(
        tmp_path: Path, fresh_db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As after the upgrade to 0018 (which fills nothing in) or a publish of the previous release: the host's
    summary summed after its next change has every type's tightest GPU, marked true."""
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "pub-h", scale=2)
    svc.publish_fleet()
    host = {"h": svc.host_id(None)}  # type: ignore[arg-type]
    with svc.tx() as s:
        s.execute(text("UPDATE fleet_host_types SET tightest_mb = NULL WHERE host_id = :h"), host)
        s.execute(text("UPDATE fleet_hosts SET fit_generation = NULL WHERE host_id = :h"), host)
    svc.allocate("T4-4Q", vm="web1")
    _settled(svc)
    with svc.reads() as s:
        kept = dict(s.execute(text("SELECT short, tightest_mb FROM fleet_host_types WHERE host_id = :h"), host).all())
        fresh = dict(s.execute(text(_TIGHTEST), host).all())
        marks = s.execute(text("SELECT generation, fit_generation FROM fleet_hosts WHERE host_id = :h"), host).one()
    assert kept == fresh and kept["T4-4Q"] == 16384 - 4096 and kept["T4-2Q"] == 16384
    assert marks[0] == marks[1]


def test_a_lookup_between_changes_keeps_the_change_statement_prepared(
        tmp_path: Path, fresh_db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """psycopg 3 forgets every statement it prepared at a ROLLBACK: a lookup (`svc.reads()`, which a release
    starts with) ends with COMMIT instead, so the change statement is planned once per connection, not per change."""
    if not fresh_db_url.startswith("postgresql"):
        pytest.skip("statements are prepared on PostgreSQL")
    svc = _service(tmp_path, fresh_db_url, monkeypatch, "pub-m")
    svc.publish_fleet()
    for _ in range(3):
        svc.release(svc.allocate("T4-4Q")["uuid"])
    with svc.tx() as s:
        runs = s.execute(text("SELECT generic_plans + custom_plans FROM pg_prepared_statements "
                              "WHERE statement LIKE 'WITH l AS%'")).scalar()
    assert runs == 6  # three allocations and three releases, on the one connection (before: 1 or 2)


def _allocate_while_held(svc: Service, holder: Any, probe: Any, host: dict[str, Any]) -> None:
    """A change of the host (a T4-4Q for VM web2) that waits for the publish lock `holder` holds, until `holder`
    commits."""
    import threading

    change = threading.Thread(target=lambda: svc.allocate("T4-4Q", vm="web2"))
    change.start()
    _wait_for_the_lock(probe, host)
    holder.commit()
    change.join(30)
    assert not change.is_alive()


def _wait_for_the_lock(probe: Any, host: dict[str, Any]) -> None:
    """Until the host's change waits for its publish lock (another connection holds it)."""
    import time

    waiting = text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                   "AND classid = 1986490485 AND objid = :h AND objsubid = 2")
    for _ in range(300):
        if probe.execute(waiting, host).scalar():
            return
        probe.rollback()
        time.sleep(0.1)
    pytest.fail("the change never waited for its host's publish lock")
