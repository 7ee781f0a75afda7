"""`vgpumgr gpu compact --apply` end to end: two simulated hosts sharing one fleet database (PostgreSQL), each its
own service and simulated libvirtd (tests/migration_hosts.py); host-a's L40S in mixed-size mode, fragmented so
no L40S-24Q start is free. `fleet place` names the GPU and the compact that frees a start; `--apply` live-migrates
the VM in the way to host-b, and a migration that fails stops the compaction with what was moved before it.

One pair of hosts for the module (each costs seconds); every test starts by emptying both."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from migration_hosts import SimHost, sim_hosts
from simhost import run

from vgpumgr.fleet.remote import UnixHTTPConnection
from vgpumgr.placement.placer import Policy

L40S = "0000:3d:00.0"


@pytest.fixture(scope="module")
def pair(pg_server: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimHost, SimHost]]:
    url = pg_server.create_database("compact")  # type: ignore[attr-defined]
    # the servers' own heartbeats stay off: the fleet rows are those the in-process services publish, at their
    # simulated libvirtds' URIs
    with sim_hosts(tmp_path_factory.mktemp("compact"), "l40s-vfio", "l40s-vfio", db=url,
                   env_extra={"VGPUMGR_FLEET_PUBLISH": "0"}) as (a, b):
        for h in (a, b):
            h.svc.fleet.migration_uri = h.uri
        a.url = url  # type: ignore[attr-defined]
        yield a, b


@pytest.fixture
def hosts(pair: tuple[SimHost, SimHost], monkeypatch: pytest.MonkeyPatch) -> tuple[SimHost, SimHost]:
    a, b = pair
    for h in (a, b):
        for vm in h.domains():
            h.svc.delete_vm(vm)
        for x in h.live():
            h.svc.release(x.get("uuid") or x["pci_address"])
    if _slots(a, monkeypatch)["mode"] != "mixed":
        rc, _, err = _cli(a, monkeypatch, "gpu", "mode", L40S, "--mixed")
        assert rc == 0, err
    return a, b


def _cli(h: SimHost, monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[int, str, str]:
    """`vgpumgr` on host `h` (its records in the shared database; the command itself publishes nothing)."""
    monkeypatch.setenv("VGPUMGR_HOSTNAME", h.name)
    monkeypatch.setenv("VGPUMGR_FLEET_PUBLISH", "0")
    return run("--sysfs-root", str(h.server.root), "--state-dir", str(h.server.cfg.state_dir),
               "--connect", h.server.cfg.libvirt_uri, "--db", h.server.cfg.db_url, *argv)


def _vms(h: SimHost, *placed: tuple[str, int]) -> None:
    for vm, at in placed:
        h.svc.create_vm(vm, vgpus=["L40S-2Q"], policy=Policy(placement_id=at), start=True)


def _slots(h: SimHost, monkeypatch: pytest.MonkeyPatch) -> dict:
    rc, out, err = _cli(h, monkeypatch, "gpu", "slots", L40S, "--json")
    assert rc == 0, err
    return json.loads(out)


def _creatable(m: dict, short: str) -> list[int]:
    return next(t["creatable"] for t in m["types"] if t["name"].split()[-1] == short)


def _publish(*hs: SimHost) -> None:
    for h in hs:
        h.svc.publish_fleet()


def test_fleet_place_hints_and_apply_moves_the_vm_to_host_b(hosts: tuple[SimHost, SimHost],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = hosts
    _vms(a, ("vm7", 0), ("vm9", 24), ("vm8", 28))  # every 24Q start is in the way of a 2Q: 42 GB free
    b.svc.allocate("L40S-2Q", vm="b-local")  # equal-size mode on host-b: no 24Q there either
    _publish(a, b)
    assert _creatable(_slots(a, monkeypatch), "L40S-24Q") == []

    # fleet place: no host fits; the hint names host-a's GPU and the compact that frees a start with one move
    rc, out, _ = _cli(a, monkeypatch, "fleet", "place", "--type", "L40S-24Q", "--json")
    d = json.loads(out)
    assert rc == 4 and d["choice"] is None
    assert {k: d["compact"][k] for k in ("host", "gpu", "type", "moves", "start", "vms", "free_gb")} == {
        "host": "host-a", "gpu": L40S, "type": "L40S-24Q", "moves": 1, "start": 0, "vms": ["vm7"], "free_gb": 42}
    # the fleet's plan for it (`fleet compact`): the same GPU, vm7 to host-b
    assert [(m["vm"], m["to"]) for m in d["compact"]["plan"]] == [("vm7", "host-b")]
    rc, out, _ = _cli(a, monkeypatch, "fleet", "place", "--type", "L40S-24Q", "--explain")
    assert rc == 4 and out.endswith(
        f"hint: {L40S} on host-a is fragmented: `vgpumgr gpu compact {L40S} --for L40S-24Q` (on host-a) frees a "
        "start by moving 1 VM\n")
    rc, _, err = _cli(b, monkeypatch, "fleet", "place", "--type", "L40S-24Q")  # any host of the fleet says it
    assert rc == 4 and f"`vgpumgr gpu compact {L40S} --for L40S-24Q` (on host-a)" in err and "--explain" in err
    c = UnixHTTPConnection(str(b.server.sock), timeout=60)  # and REST
    c.request("GET", "/v1/fleet/place?type=L40S-24Q", headers={"Authorization": f"Bearer {b.operator_token}"})
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["compact"] == d["compact"]

    rc, out, err = _cli(a, monkeypatch, "gpu", "compact", L40S, "--for", "L40S-24Q", "--apply", "--json")
    p = json.loads(out)
    assert rc == 0, err
    assert [(x["vm"], x["to"]) for x in p["applied"]] == [("vm7", b.uri)]
    assert p["failed"] is None and p["start"] == 0 and p["creatable"] is True
    # the 24Q start is creatable on host-a now, and a 24Q VM takes it
    assert 0 in _creatable(_slots(a, monkeypatch), "L40S-24Q")
    rc, _, err = _cli(a, monkeypatch, "vm", "create", "big", "--vgpu", "L40S-24Q")
    assert rc == 0, err
    assert [v["vgpu"] for v in _slots(a, monkeypatch)["vgpus"]] == ["L40S-24Q of big", "L40S-2Q of vm9",
                                                                    "L40S-2Q of vm8"]
    # vm7 runs on host-b with its vGPU; nothing of it is left on host-a
    assert b.domains()["vm7"] == "running" and "vm7" not in a.domains()
    [there] = b.live("vm7")
    assert there["state"] == "active" and there["type_name"].endswith("L40S-2Q") and a.live("vm7") == []
    [ev] = a.events("gpu.compact")[-1:]
    assert ev.outcome == "ok" and ev.gpu == L40S
    assert [x["vm"] for x in ev.detail["applied"]] == ["vm7"] and ev.detail["creatable"] is True


def test_a_failed_migration_stops_the_compaction_with_what_was_moved(hosts: tuple[SimHost, SimHost],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = hosts
    _vms(a, ("f1", 0), ("f2", 4), ("f3", 24), ("f4", 28))  # each 24Q start needs two moves
    for n in range(3):
        b.svc.allocate("L40S-2Q", vm=f"b-local{n}")  # host-b has one VF left: room for f1, not for f2
    _publish(a, b)
    before = _slots(a, monkeypatch)["vgpus"]
    f2_vf = a.live("f2")[0]["pci_address"]

    rc, out, err = _cli(a, monkeypatch, "gpu", "compact", L40S, "--for", "L40S-24Q", "--apply", "--json")
    p = json.loads(out)
    assert [mv["vm"] for mv in p["moves"]] == ["f1", "f2"] and all(mv["to"] == b.uri for mv in p["moves"])
    assert rc == 4, err
    assert [x["vm"] for x in p["applied"]] == ["f1"]
    assert p["failed"]["vm"] == "f2" and p["failed"]["to"] == b.uri and "migrate begin" in p["failed"]["error"]
    assert p["creatable"] is None
    assert f"stopped: migrating VM f2 to {b.uri} failed:" in err and f"already moved: f1 to {b.uri}" in err
    assert "VM f2 was not moved" in err
    from vgpumgr.ops.compact import text

    assert text(p).splitlines()[1:] == [f"  move f1 (L40S-2Q of f1 at 0) -> {b.uri} [done]",
                                        f"  move f2 (L40S-2Q of f2 at 4) -> {b.uri} [failed]"]

    # nothing half-made: f1 moved whole, f2 runs on at host-a where it was, host-b holds nothing for it
    assert b.domains()["f1"] == "running" and a.live("f1") == []
    assert a.domains()["f2"] == "running" and b.live("f2") == [] and "f2" not in b.domains()
    [f2] = a.live("f2")
    assert f2["state"] == "active" and f2["pci_address"] == f2_vf
    assert _slots(a, monkeypatch)["vgpus"] == [v for v in before if v["vgpu"] != "L40S-2Q of f1"]
    assert sorted(x["vm"] for x in b.live()) == ["b-local0", "b-local1", "b-local2", "f1"]
    [ev] = a.events("gpu.compact")[-1:]
    assert ev.outcome == "failed" and "VM f2" in ev.error
    assert [x["vm"] for x in ev.detail["applied"]] == ["f1"] and ev.detail["failed"]["vm"] == "f2"

    # asked again with host-b full (and published so): f2 alone is in the way of start 0, with nowhere to go
    _publish(b)
    rc, out, err = _cli(a, monkeypatch, "gpu", "compact", L40S, "--for", "L40S-24Q")
    assert rc == 4 and "no destination" in out  # host-b is full now: the plan says so and moves nothing


def test_a_start_taken_while_the_vms_moved_is_reported(hosts: tuple[SimHost, SimHost],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from vgpumgr.errors import Conflict
    from vgpumgr.ops import compact, migrate

    a, b = hosts
    _vms(a, ("r1", 0), ("r2", 24))
    _publish(a, b)
    real = migrate.migrate_vm

    def racing(*args: object, **kw: object) -> dict:
        res = real(*args, **kw)  # the move succeeds; meanwhile another placement takes the freed start
        a.svc.allocate("L40S-12Q", vm="squatter", policy=Policy(placement_id=0))
        return res

    monkeypatch.setattr(migrate, "migrate_vm", racing)
    p = compact.apply(a.svc, compact.plan(a.svc, L40S, "L40S-24Q"))
    assert [x["vm"] for x in p["applied"]] == ["r1"] and p["failed"] is None
    assert p["creatable"] is False and p["taken_by"] == ["L40S-12Q of squatter"]
    err = compact.failure(p)
    assert isinstance(err, Conflict) and "moved r1 to" in err.message
    assert "placement ID 0 of NVIDIA L40S-24Q is not creatable now: taken by L40S-12Q of squatter" in err.message
    [ev] = a.events("gpu.compact")[-1:]
    assert ev.outcome == "failed" and ev.detail["creatable"] is False
