"""Licence editions, seat counting per VM and per GPU, pool choice, modes and usage reports."""

from __future__ import annotations

import uuid
from datetime import date, timedelta

import pytest

from vgpumgr.audit import chain as audit
from vgpumgr.db import store
from vgpumgr.db.session import session_factory
from vgpumgr.errors import Conflict, InvalidInput, NoSeat
from vgpumgr.licensing import seats as licensing

TODAY = date(2026, 6, 1)


def test_edition_candidates() -> None:
    assert licensing.edition_candidates("A") == ["vApps"]
    assert licensing.edition_candidates("b") == ["vPC", "vWS"]
    assert licensing.edition_candidates("C") == ["vCS", "vWS"]
    assert licensing.edition_candidates("Q") == ["vWS"]
    assert licensing.edition_candidates(None) == []
    assert licensing.edition_candidates("passthrough") == ["vApps", "vCS", "vWS"]
    assert licensing.edition_candidates("passthrough", ["vws", "vCS"]) == ["vCS", "vWS"]
    with pytest.raises(InvalidInput):
        licensing.edition_candidates("Z")
    with pytest.raises(InvalidInput):
        licensing.edition_candidates("passthrough", ["GRID"])


class World:
    """One host with two GPUs and helpers to place/remove vGPUs the way the service will."""

    def __init__(self, session) -> None:
        self.s = session
        self.host = store.upsert_host(session, "h1")
        self.gpu_a = store.upsert_gpu(session, self.host, "0000:3b:00.0", model="NVIDIA A40")
        self.gpu_b = store.upsert_gpu(session, self.host, "0000:5e:00.0", model="NVIDIA A40")

    def vm(self, name: str):
        return store.upsert_vm(self.s, self.host, name)

    def place(self, vm, gpu, series: str, mode: str = "enforce", link_after: bool = False):
        """Seat first, then the allocation carrying it (the service's order); or link afterwards."""
        lease = None if link_after else licensing.acquire(self.s, vm, gpu, series, mode, today=TODAY)
        alloc = store.reserve_allocation(self.s, self.host, backend="mdev", parent=gpu.address,
                                         type_id="nvidia-558", uuid=str(uuid.uuid4()), gpu=gpu, vm=vm,
                                         series=series, lease=lease)
        if link_after:
            lease = licensing.acquire(self.s, vm, gpu, series, mode, allocation=alloc, today=TODAY)
        return alloc, lease

    def held(self, vm) -> list[int]:
        return [lease.id for lease in licensing.leases(self.s, vm=vm)]

    def usage(self) -> dict[str, licensing.EditionUsage]:
        return {u.edition: u for u in licensing.usage(self.s, today=TODAY)}


@pytest.fixture
def world(fresh_db_url: str):
    with session_factory(fresh_db_url)() as s:
        yield World(s)
        s.commit()


def test_per_vm_unit_counts_one_seat_per_vm(world: World) -> None:
    licensing.add_pool(world.s, name="ws", edition_name="vWS", seats=2, unit="vm")
    vm1, vm2, vm3 = world.vm("a"), world.vm("b"), world.vm("c")
    a1, l1 = world.place(vm1, world.gpu_a, "Q")
    a2, l2 = world.place(vm1, world.gpu_b, "Q")  # a second vGPU of the same VM: same seat
    assert l1 is not None and l2.id == l1.id
    world.place(vm2, world.gpu_a, "Q")
    assert world.usage()["vWS"].used == 2 and world.usage()["vWS"].free == 0
    with pytest.raises(NoSeat, match="vWS"):
        world.place(vm3, world.gpu_a, "Q")

    store.release(world.s, a1)
    assert world.held(vm1) == [l1.id]  # vm1 still holds a2
    store.release(world.s, a2)
    assert world.held(vm1) == []
    _, l3 = world.place(vm3, world.gpu_a, "Q")
    assert l3.id != l1.id and world.usage()["vWS"].free == 0


def test_per_gpu_unit_counts_one_seat_per_physical_gpu(world: World) -> None:
    licensing.add_pool(world.s, name="cs", edition_name="vCS", seats=3, unit="gpu")
    vm = world.vm("train")
    a1, l1 = world.place(vm, world.gpu_a, "C")
    a2, l2 = world.place(vm, world.gpu_a, "C", link_after=True)
    _, l3 = world.place(vm, world.gpu_b, "C")
    assert (a1.lease_id, a2.lease_id) == (l1.id, l1.id)
    assert l1.id == l2.id and l3.id != l1.id
    u = world.usage()["vCS"]
    assert (u.seats, u.used, u.free) == (3, 2, 1)
    assert sorted(h.gpu for h in u.holders) == ["0000:3b:00.0", "0000:5e:00.0"]
    assert {h.vm for h in u.holders} == {"train"}
    store.release(world.s, a1)
    assert world.usage()["vCS"].used == 2
    store.release(world.s, a2)
    assert world.usage()["vCS"].used == 1 and world.held(vm) == [l3.id]


def test_cheapest_edition_with_a_free_seat_wins(world: World) -> None:
    licensing.add_pool(world.s, name="ws", edition_name="vWS", seats=5, unit="vm")
    licensing.add_pool(world.s, name="pc", edition_name="vPC", seats=1, unit="vm")
    _, first = world.place(world.vm("office1"), world.gpu_a, "B")
    _, second = world.place(world.vm("office2"), world.gpu_a, "B")
    assert first.pool.edition == "vPC" and second.pool.edition == "vWS"
    usage = world.usage()
    assert (usage["vPC"].free, usage["vWS"].used) == (0, 1)


def test_a_vm_reuses_a_seat_it_already_holds(world: World) -> None:
    licensing.add_pool(world.s, name="pc", edition_name="vPC", seats=5, unit="vm")
    licensing.add_pool(world.s, name="ws", edition_name="vWS", seats=5, unit="vm")
    vm = world.vm("cad")
    _, ws = world.place(vm, world.gpu_a, "Q")
    _, b = world.place(vm, world.gpu_b, "B")  # the vWS seat covers B too: no vPC seat taken
    assert b.id == ws.id and world.usage()["vPC"].used == 0


def test_expired_pools_do_not_count(world: World) -> None:
    licensing.add_pool(world.s, name="old", edition_name="vApps", seats=10, unit="vm",
                       expires=TODAY - timedelta(days=1))
    licensing.add_pool(world.s, name="last-day", edition_name="vApps", seats=1, unit="vm", expires=TODAY)
    _, lease = world.place(world.vm("rds1"), world.gpu_a, "A")
    assert lease.pool.name == "last-day"  # valid through its expiry date
    with pytest.raises(NoSeat):
        world.place(world.vm("rds2"), world.gpu_a, "A")
    u = world.usage()["vApps"]
    assert (u.seats, u.free) == (1, 0)
    assert [(p.name, p.expired) for p in u.pools] == [("last-day", False), ("old", True)]


def test_warn_mode_allows_and_audits(world: World) -> None:
    vm = world.vm("nolicence")
    alloc, lease = world.place(vm, world.gpu_a, "Q", mode="warn", link_after=True)
    assert lease is None and alloc.lease_id is None
    events = audit.query(world.s, vm="nolicence")
    assert [(e.action, e.outcome) for e in events] == [(audit.LICENCE_ACQUIRE, "warning")]
    assert "vWS" in events[0].error and events[0].host == "h1" and events[0].vgpu == alloc.uuid


def test_off_mode_and_unlicensed_types_take_nothing(world: World) -> None:
    licensing.add_pool(world.s, name="ws", edition_name="vWS", seats=1, unit="vm")
    _, lease = world.place(world.vm("x"), world.gpu_a, "Q", mode="off")
    assert lease is None
    _, lease = world.place(world.vm("y"), world.gpu_a, None)  # e.g. an mtty or i915 mdev
    assert lease is None
    assert world.usage()["vWS"].used == 0 and audit.query(world.s) == []
    with pytest.raises(InvalidInput):
        world.place(world.vm("z"), world.gpu_a, "Q", mode="strict")


def test_pool_management(world: World) -> None:
    licensing.add_pool(world.s, name="ws", edition_name="vws", seats=1, unit="vm")
    assert licensing.get_pool(world.s, "ws").edition == "vWS"
    with pytest.raises(Conflict):
        licensing.add_pool(world.s, name="ws", edition_name="vWS", seats=1)
    with pytest.raises(InvalidInput):
        licensing.add_pool(world.s, name="bad", edition_name="vWS", seats=1, unit="socket")
    alloc, _ = world.place(world.vm("v"), world.gpu_a, "Q")
    licensing.change_pool(world.s, "ws", seats=0)  # shrinking below use is allowed and shown
    assert world.usage()["vWS"].free == 0 and world.usage()["vWS"].used == 1
    with pytest.raises(Conflict, match="in use"):
        licensing.remove_pool(world.s, "ws")
    store.release(world.s, alloc)
    licensing.remove_pool(world.s, "ws")
    assert licensing.list_pools(world.s) == [] and world.usage() == {}


def test_two_writers_cannot_take_the_last_seat_twice(fresh_db_url: str) -> None:
    import threading

    factory = session_factory(fresh_db_url)
    with factory() as s:
        host = store.upsert_host(s, "h1")
        vms = [store.upsert_vm(s, host, f"vm{i}") for i in range(2)]
        licensing.add_pool(s, name="ws", edition_name="vWS", seats=1, unit="vm")
        s.commit()
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def take(vm) -> None:
        with factory() as s:
            barrier.wait()
            try:
                licensing.acquire(s, vm, None, "Q", "enforce", today=TODAY)
                s.commit()
                outcomes.append("seat")
            except NoSeat:
                outcomes.append("no-seat")

    threads = [threading.Thread(target=take, args=(vm,)) for vm in vms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["no-seat", "seat"]
    with factory() as s:
        assert len(licensing.leases(s)) == 1
