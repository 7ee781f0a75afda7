"""`vgpumgr fleet compact` end to end: three simulated hosts sharing one fleet database (PostgreSQL), each its own
service and simulated libvirtd (tests/migration_hosts.py), one L40S with 4 VFs each. host-a's L40S is in
mixed-size mode and fragmented (each 24Q start needs two moves, no VF free); host-b's and host-c's are in
equal-size mode, each holding one stray 2Q VM. L40S-24Q fits nowhere; the fewest moves that make room are one:
host-b's stray VM to host-c. `fleet place` names that plan, `fleet compact --apply` on host-b runs it, and the
24Q then places on host-b. Cordons and the per-host limit shape the plan."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from migration_hosts import SimHost, sim_hosts
from simhost import run

from vgpumgr.placement.placer import Policy

L40S = "0000:3d:00.0"


@pytest.fixture(scope="module")
def fleet(pg_server: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SimHost]]:
    url = pg_server.create_database("fleetcompact")  # type: ignore[attr-defined]
    with sim_hosts(tmp_path_factory.mktemp("fleetcompact"), "l40s-vfio", "l40s-vfio", "l40s-vfio", db=url,
                   env_extra={"VGPUMGR_FLEET_PUBLISH": "0"}) as hosts:
        for h in hosts:
            h.svc.fleet.migration_uri = h.uri
        yield hosts


def _cli(h: SimHost, monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setenv("VGPUMGR_HOSTNAME", h.name)
    monkeypatch.setenv("VGPUMGR_FLEET_PUBLISH", "0")
    return run("--sysfs-root", str(h.server.root), "--state-dir", str(h.server.cfg.state_dir),
               "--connect", h.server.cfg.libvirt_uri, "--db", h.server.cfg.db_url, *argv)


def _publish(hosts: list[SimHost]) -> None:
    for h in hosts:
        h.svc.publish_fleet()


def _plan(h: SimHost, monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple[int, dict, str]:
    rc, out, err = _cli(h, monkeypatch, "fleet", "compact", "--for", "L40S-24Q", "--json", *extra)
    return rc, json.loads(out) if out else {}, err


def _place_json(h: SimHost, monkeypatch: pytest.MonkeyPatch) -> dict:
    rc, out, _ = _cli(h, monkeypatch, "fleet", "place", "--type", "L40S-24Q", "--json")
    assert rc == 4
    return json.loads(out)["compact"]


def test_the_fewest_moves_across_hosts_make_room_and_the_type_then_places(fleet: list[SimHost],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c = fleet
    rc, _, err = _cli(a, monkeypatch, "gpu", "mode", L40S, "--mixed")
    assert rc == 0, err
    for vm, at in (("f1", 0), ("f2", 4), ("f3", 24), ("f4", 28)):
        a.svc.create_vm(vm, vgpus=["L40S-2Q"], policy=Policy(placement_id=at), start=True)
    b.svc.create_vm("stray", vgpus=["L40S-2Q"], start=True)
    c.svc.create_vm("c1", vgpus=["L40S-2Q"], start=True)
    _publish(fleet)

    # nothing fits; fleet place names the plan: one move, host-b's stray VM to host-c (host-a has no VF free)
    rc, out, _ = _cli(a, monkeypatch, "fleet", "place", "--type", "L40S-24Q", "--json")
    d = json.loads(out)
    assert rc == 4 and d["choice"] is None
    hint = d["compact"]
    assert (hint["host"], hint["gpu"], hint["how"], hint["moves"], hint["vms"]) == ("host-b", L40S, "empty-gpu", 1,
                                                                                   ["stray"])
    assert [(m["vm"], m["from"], m["to"]) for m in hint["plan"]] == [("stray", "host-b", "host-c")]
    rc, _, err = _cli(c, monkeypatch, "fleet", "place", "--type", "L40S-24Q")
    assert rc == 4 and "`vgpumgr fleet compact --for L40S-24Q --apply` (on host-b) moves stray to host-c" in err

    # fleet place's hint searches with a budget of destination lookups: past it, it says so and names the command
    # that searches every option (here one lookup: host-b's option needs two, its type's hosts and then stray's)
    monkeypatch.setattr("vgpumgr.ops.fleet_compact.HINT_LOOKUPS", 1)
    rc, out, _ = _cli(a, monkeypatch, "fleet", "place", "--type", "L40S-24Q", "--json")
    hint = json.loads(out)["compact"]
    assert rc == 4 and hint["cut_short"] and hint["full_plan"] == "vgpumgr fleet compact --for L40S-24Q"
    assert (hint["host"], hint["how"], hint["moves"], hint["plan"]) == ("host-a", "placement", 2, None)
    rc, _, err = _cli(a, monkeypatch, "fleet", "place", "--type", "L40S-24Q")
    assert rc == 4 and "plan search was cut short: `vgpumgr fleet compact --for L40S-24Q` gives the full plan" in err
    assert "gpu compact 0000:3d:00.0 --for L40S-24Q` (on host-a) frees a start by moving 2 VMs" in err
    p = a.svc.fleet_compact_plan("L40S-24Q", fits_check=False, lookups=1)
    assert not p["feasible"] and p["cut_short"] and "cut short after 1 destination lookup(s), 0 of" in p["why"]
    monkeypatch.setattr("vgpumgr.ops.fleet_compact.HINT_LOOKUPS", 0)
    rc, out, _ = _cli(c, monkeypatch, "fleet", "place", "--type", "L40S-24Q", "--json")
    assert rc == 4 and json.loads(out)["compact"]["cut_short"]
    monkeypatch.undo()

    # a large fleet's hint reads the GPUs with the most room first, and the plan the GPUs with the fewest vGPUs,
    # each up to a bound: past it the answer says so, and what it names is still a valid plan
    whole = _place_json(a, monkeypatch)
    monkeypatch.setattr("vgpumgr.ops.fleet.EVERY_HOST_UP_TO", 0)
    assert _place_json(a, monkeypatch) == whole and "cut_short" not in whole  # all 3 GPUs read: the same answer
    monkeypatch.setattr("vgpumgr.ops.fleet.FRAGMENTED_GPUS", 1)  # host-b's or host-c's, 46 GB free: not judged
    monkeypatch.setattr("vgpumgr.ops.fleet_compact.HINT_GPUS", 1)  # host-b's or host-c's, one stray VM each
    hint = _place_json(a, monkeypatch)
    assert hint["cut_short"] and hint["full_plan"] == "vgpumgr fleet compact --for L40S-24Q"
    assert (hint["how"], hint["moves"]) == ("empty-gpu", 1)
    [mv] = hint["plan"]
    assert {(mv["vm"], mv["from"], mv["to"])} <= {("stray", "host-b", "host-c"), ("c1", "host-c", "host-b")}
    monkeypatch.setattr("vgpumgr.ops.fleet_compact.HINT_GPUS", 3)  # the plan reads all: only the hint was cut
    hint = _place_json(a, monkeypatch)
    assert hint["cut_short"] and (hint["host"], hint["plan"]) == ("host-b", whole["plan"])
    monkeypatch.undo()

    rc, p, _ = _plan(a, monkeypatch)
    assert rc == 0 and p["feasible"] and (p["host"], p["gpu"], p["how"]) == ("host-b", L40S, "empty-gpu")
    [mv] = p["moves"]
    assert (mv["vm"], mv["from"], mv["to"], mv["to_uri"]) == ("stray", "host-b", "host-c", c.uri)
    assert "same board and vGPU manager as VM stray's" in mv["why"]

    # a cordoned host-c: neither a destination nor a GPU to free; host-a's two moves go to host-b instead...
    rc, _, err = _cli(a, monkeypatch, "host", "cordon", "host-c", "--reason", "BIOS update")
    assert rc == 0, err
    rc, p, _ = _plan(a, monkeypatch)
    assert rc == 0 and (p["host"], p["how"], p["start"]) == ("host-a", "placement", 0)
    assert [(m["vm"], m["to"]) for m in p["moves"]] == [("f1", "host-b"), ("f2", "host-b")]
    # ...unless one host may take only one of them: then nothing frees a 24Q start
    rc, p, err = _plan(a, monkeypatch, "--per-host", "1")
    assert rc == 4 and not p["feasible"] and "no destination" in p["why"] and "no plan frees" in err
    rc, p, _ = _plan(a, monkeypatch, "--max-moves", "1")
    assert rc == 4 and not p["feasible"]  # host-b's own stray VM has nowhere to go but cordoned host-c
    rc, _, err = _cli(a, monkeypatch, "host", "uncordon", "host-c")
    assert rc == 0, err

    # applied where the VMs run: elsewhere it says where
    rc, _, err = _cli(a, monkeypatch, "fleet", "compact", "--for", "L40S-24Q", "--apply")
    assert rc == 4 and "on host-b" in err
    rc, p, err = _plan(b, monkeypatch, "--apply")
    assert rc == 0, err
    assert [(x["vm"], x["to"]) for x in p["applied"]] == [("stray", "host-c")] and p["failed"] is None
    assert c.domains()["stray"] == "running" and "stray" not in b.domains() and b.live("stray") == []
    assert [x["state"] for x in c.live("stray")] == ["active"]
    for h, vms in ((a, {"f1", "f2", "f3", "f4"}), (c, {"c1", "stray"})):
        assert {vm for vm, state in h.domains().items() if state == "running"} == vms
    [ev] = b.events("fleet.compact")[-1:]
    assert ev.outcome == "ok" and [x["vm"] for x in ev.detail["applied"]] == ["stray"]

    # the hosts publish their changes: L40S-24Q places on host-b now, and a VM gets it
    _publish(fleet)
    rc, out, err = _cli(a, monkeypatch, "fleet", "place", "--type", "L40S-24Q", "--json")
    assert rc == 0 and json.loads(out)["choice"]["host"] == "host-b", err
    rc, _, err = _cli(b, monkeypatch, "vm", "create", "big", "--vgpu", "L40S-24Q")
    assert rc == 0, err
    rc, p, _ = _plan(a, monkeypatch)  # room is there already: nothing to move
    assert rc == 0 and p["feasible"] and p["moves"] == [] and p["placed"] == "host-b"
