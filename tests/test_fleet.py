"""Four simulated hosts, each its own service on its own unix socket, publishing into one PostgreSQL server the
suite starts: capacity after allocations on each, placement with its reasons, cordon, a live migration's driver
rule, two placers racing for the last slot, the host overruling what the fleet thought free, and a SIGKILLed
host going stale within its window and never being chosen.

The tests run in file order on one fleet (module scope); the host killed last is not used after."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fleethosts import Fleet
from simhost import run

from api import tokens
from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.config import Config
from vgpumgr.hostfs.root import Host
from vgpumgr.sim import profiles

HEARTBEAT_S = 0.5
WINDOW_S = HEARTBEAT_S * 3  # VGPUMGR_FLEET_STALE_FACTOR's default
T4, L40S_MIXED = "0000:3b:00.0", "0000:3d:00.0"
SEED = (("gpu-t4", "t4-a", "T4-4Q"), ("gpu-t4", "t4-b", "T4-4Q"), ("gpu-l40s-a", "web1", "L40S-4Q"),
        ("gpu-l40s-old", "old-a", "L40S-4Q"), ("gpu-mixed", "mx-a", "T4-4Q"))


@pytest.fixture(scope="module")
def fleet(pg_server: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    url = pg_server.create_database("fleet")  # type: ignore[attr-defined]
    cfg = Config.resolve(sysfs_root=str(profiles.create(tmp / "admin-sim", "t4")), state_dir=str(tmp / "admin"),
                         db=url)
    token = tokens.create_token(cfg, "fleet-admin", "admin")
    f = Fleet(tmp, url, token, heartbeat_s=HEARTBEAT_S)
    f.add("gpu-t4", "t4")
    f.add("gpu-l40s-a", "l40s-vfio", vfs=4)
    f.add("gpu-l40s-old", "l40s-vfio", vfs=4, driver_version="570.124.03")
    f.add("gpu-mixed", "mixed", vfs=4)
    try:
        f.wait_ready()
        for host, vm, vtype in SEED:  # what every test starts from (a test run alone too)
            r = f.hosts[host].post("/v1/vgpus", {"type": vtype, "vm": vm})
            assert r.status_code == 201, r.text
        yield f
    finally:
        f.stop()


def cli(f: Fleet, *argv: str) -> tuple[int, str, str]:
    """`vgpumgr` as an administrator runs it on a machine that shares the database (it publishes nothing)."""
    admin = f.tmp / "admin-sim"
    return run("--sysfs-root", str(admin), "--state-dir", str(f.tmp / "admin"), "--db", f.db_url, *argv)


def place(f: Fleet, **params: object) -> dict:
    return f.hosts["gpu-mixed"].get("/v1/fleet/place", **params)


def reasons(d: dict) -> dict[str, tuple[str, str]]:
    return {r["host"]: (r["code"], r["reason"]) for r in d["rejected"]}


def test_every_host_publishes_its_gpus_with_their_facts(fleet: Fleet) -> None:
    hosts = {h["host"]: h for h in fleet.hosts["gpu-t4"].get("/v1/fleet/hosts")}
    assert set(hosts) == {"gpu-t4", "gpu-l40s-a", "gpu-l40s-old", "gpu-mixed"}
    for name, h in hosts.items():
        assert not h["stale"] and not h["cordoned"] and h["stale_after_s"] == WINDOW_S
        assert h["endpoint"] == f"unix:{fleet.hosts[name].sock}"
        assert h["migration_uri"] == f"qemu+ssh://{name}/system"
    assert hosts["gpu-l40s-old"]["driver_version"] == "570.124.03"
    assert hosts["gpu-l40s-a"]["driver_version"] == hosts["gpu-mixed"]["driver_version"] == "580.159.04"
    gpus = {(g["host"], g["address"]): g for g in fleet.hosts["gpu-t4"].get("/v1/fleet/gpus")}
    assert len(gpus) == 1 + 1 + 1 + 4
    mixed_l40s = gpus[("gpu-mixed", L40S_MIXED)]
    assert (mixed_l40s["pci_id"], mixed_l40s["subsystem_id"], mixed_l40s["mode"]) == (
        "10de:26b9", "10de:1851", "nvidia-vf")
    assert gpus[("gpu-mixed", "0000:65:00.0")]["mode"] == "mig"
    assert gpus[("gpu-t4", T4)]["mode"] == "mdev" and gpus[("gpu-t4", T4)]["numa_node"] == 0


def test_capacity_follows_the_allocations_on_each_host(fleet: Fleet) -> None:
    h = fleet.hosts  # the fixture's SEED allocations
    # published in the allocation's own transaction (tests/test_fleet_publish.py): no heartbeat to wait for
    t4 = {r["host"]: r for r in h["gpu-l40s-old"].get("/v1/fleet/capacity", type="T4-4Q")["hosts"]}
    assert (t4["gpu-t4"]["free"], t4["gpu-t4"]["used"]) == (2, 2)
    assert (t4["gpu-mixed"]["free"], t4["gpu-mixed"]["used"]) == (3, 1)
    l40s = {r["host"]: r for r in h["gpu-t4"].get("/v1/fleet/capacity", type="NVIDIA L40S-4Q")["hosts"]}
    assert {k: (v["free"], v["used"]) for k, v in l40s.items()} == {
        "gpu-l40s-a": (3, 1), "gpu-l40s-old": (3, 1), "gpu-mixed": (4, 0)}  # 4 VFs each: one vGPU per VF
    # equal-size mode: a T4 holding 4 GB vGPUs offers no 8 GB one
    assert all(r["free"] == 0 for r in h["gpu-t4"].get("/v1/fleet/capacity", type="T4-8Q")["hosts"])
    rc, out, _ = cli(fleet, "fleet", "capacity", "--type", "T4-4Q")
    assert rc == 0 and "gpu-t4" in out and "5 free on hosts that can be chosen" in out
    rc, out, _ = cli(fleet, "fleet", "capacity", "--json")
    by_type = {t["type"]: t for t in json.loads(out)["types"]}
    assert by_type["T4-4Q"]["hosts"] == 2 and by_type["T4-4Q"]["used"] == 3
    assert by_type["L40S-4Q"]["gpus"] == 3 and by_type["L40S-4Q"]["free"] == 10


def test_placement_ranks_hosts_and_says_why_not_the_others(fleet: Fleet) -> None:
    d = place(fleet, type="T4-4Q")
    assert d["choice"]["host"] == "gpu-t4" and d["choice"]["gpus"] == [T4]  # pack: the fuller host first
    assert [c["host"] for c in d["ranked"]] == ["gpu-t4", "gpu-mixed"]
    assert reasons(d)["gpu-l40s-a"][0] == "not-offered" and "offers no T4-4Q" in reasons(d)["gpu-l40s-a"][1]
    assert place(fleet, type="T4-4Q", policy="spread")["choice"]["host"] == "gpu-mixed"
    denied = place(fleet, type="T4-4Q", deny_model="T4")
    assert denied["choice"] is None and reasons(denied)["gpu-t4"] == ("model-denied", "model NVIDIA TU104GL [Tesla T4]"
                                                                      " denied by the policy")
    two = place(fleet, type="L40S-4Q", count=2)  # one vGPU of a GPU per VM: two L40S GPUs on one host
    assert two["choice"] is None
    assert reasons(two)["gpu-mixed"] == ("no-capacity", "no capacity: 4 free on 1 GPU(s), 2 GPUs with a free "
                                                        "L40S-4Q (one vGPU of a GPU per VM) needed")
    rc, out, err = cli(fleet, "fleet", "place", "--type", "L40S-4Q", "--count", "2")
    assert rc == 4 and "no host can take L40S-4Q now" in err
    rc, out, _ = cli(fleet, "fleet", "place", "--type", "T4-4Q", "--explain")
    assert rc == 0 and out.splitlines()[2].split()[:2] == ["chosen", "gpu-t4"]
    assert "fits, ranked 2  gpu-mixed" in out and "not-offered" in out


def test_a_migrating_vm_goes_only_where_board_and_vgpu_manager_match(fleet: Fleet) -> None:
    d = place(fleet, type="L40S-4Q", vm="web1")  # web1's L40S-4Q lives on gpu-l40s-a
    assert d["migrating"] == {"vm": "web1", "from": "gpu-l40s-a"}
    assert d["choice"]["host"] == "gpu-mixed" and d["choice"]["migration_uri"] == "qemu+ssh://gpu-mixed/system"
    why = reasons(d)
    assert why["gpu-l40s-a"] == ("source", "VM web1 runs here now")
    assert why["gpu-l40s-old"][0] == "incompatible"
    assert "vGPU manager differs: 570.124.03" in why["gpu-l40s-old"][1] and "580.159.04 at the source" in \
        why["gpu-l40s-old"][1]
    r = fleet.hosts["gpu-t4"].post("/v1/host/cordon", {"host": "nosuch"})
    assert r.status_code == 404
    with fleet.hosts["gpu-t4"].client() as c:
        r = c.get("/v1/fleet/place", params={"type": "T4-4Q", "vm": "web1"})
    assert r.status_code == 400 and "has no T4-4Q vGPU" in r.json()["detail"]


def test_a_cordoned_host_is_never_chosen(fleet: Fleet) -> None:
    admin = fleet.hosts["gpu-l40s-a"]
    r = admin.post("/v1/host/cordon", {"host": "gpu-t4", "reason": "BIOS update"})
    assert r.status_code == 200 and r.json()["changed"]
    try:
        d = place(fleet, type="T4-4Q")
        assert d["choice"]["host"] == "gpu-mixed"
        assert reasons(d)["gpu-t4"] == ("cordoned", "cordoned (BIOS update)")
        rows = {r["host"]: r for r in admin.get("/v1/fleet/capacity", type="T4-4Q")["hosts"]}
        assert rows["gpu-t4"]["cordoned"] and not rows["gpu-t4"]["placeable"]
        rc, out, _ = cli(fleet, "fleet", "hosts")
        assert rc == 0 and any(line.split()[:2] == ["gpu-t4", "cordoned"] for line in out.splitlines())
    finally:
        assert admin.post("/v1/host/uncordon", {"host": "gpu-t4"}).json()["changed"]
    assert place(fleet, type="T4-4Q")["choice"]["host"] == "gpu-t4"


def test_two_placers_race_for_the_last_slot_and_the_host_decides(fleet: Fleet) -> None:
    """L40S-48Q fills a whole L40S: with gpu-l40s-old cordoned only gpu-mixed's L40S has one left."""
    h = fleet.hosts
    assert h["gpu-t4"].post("/v1/host/cordon", {"host": "gpu-l40s-old"}).status_code == 200
    try:
        before = place(fleet, type="L40S-48Q")
        assert before["choice"]["host"] == "gpu-mixed" and before["choice"]["free"] == 1
        results: list[tuple[str, int, dict]] = []
        barrier = threading.Barrier(2)

        def placer(vm: str) -> None:
            d = h["gpu-t4"].get("/v1/fleet/place", type="L40S-48Q", vm=vm)
            chosen = h[d["choice"]["host"]]
            barrier.wait()
            r = chosen.post("/v1/vgpus", {"type": "L40S-48Q", "vm": vm})
            results.append((vm, r.status_code, r.json()))

        threads = [threading.Thread(target=placer, args=(vm,)) for vm in ("race-1", "race-2")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        codes = sorted(code for _, code, _ in results)
        assert codes == [201, 409], results
        refusal = next(body for _, code, body in results if code == 409)
        assert refusal["type"].endswith("/no-capacity") and "L40S-48Q" in refusal["detail"]
        after = place(fleet, type="L40S-48Q")
        assert after["choice"] is None and reasons(after)["gpu-mixed"][0] == "no-capacity"
    finally:
        h["gpu-t4"].post("/v1/host/uncordon", {"host": "gpu-l40s-old"})


def test_the_host_refuses_what_the_fleet_thought_free_and_the_heartbeat_corrects_it(fleet: Fleet) -> None:
    t4 = fleet.hosts["gpu-t4"]
    assert t4.post("/v1/host/cordon", {"host": "gpu-mixed"}).status_code == 200
    try:
        d = place(fleet, type="T4-4Q")
        assert d["choice"]["host"] == "gpu-t4" and d["choice"]["free"] == 2
        # meanwhile someone fills the T4 by hand, behind vgpumgr's back: nothing is published with it
        host = Host(t4.root)
        for _ in range(2):
            mdev_backend.create(host, T4, "nvidia-232", None)
        r = t4.post("/v1/vgpus", {"type": "T4-4Q", "vm": "late"})
        assert r.status_code == 409 and r.json()["type"].endswith("/no-capacity"), r.text
        deadline = time.monotonic() + 10 * HEARTBEAT_S + 5
        while time.monotonic() < deadline:  # the heartbeat re-reads the host and publishes what is there
            rows = {x["host"]: x for x in t4.get("/v1/fleet/capacity", type="T4-4Q")["hosts"]}
            if rows["gpu-t4"]["free"] == 0:
                break
            time.sleep(0.1)
        assert rows["gpu-t4"]["free"] == 0 and rows["gpu-t4"]["used"] == 4
        assert place(fleet, type="T4-4Q")["choice"] is None
    finally:
        t4.post("/v1/host/uncordon", {"host": "gpu-mixed"})


def test_a_killed_host_goes_stale_within_its_window_and_is_never_chosen(fleet: Fleet) -> None:
    reader = fleet.hosts["gpu-mixed"]
    victim = "gpu-l40s-old"
    assert reader.post("/v1/host/cordon", {"host": "gpu-mixed"}).status_code == 200
    assert reader.post("/v1/host/cordon", {"host": "gpu-l40s-a"}).status_code == 200
    try:
        assert place(fleet, type="L40S-4Q")["choice"]["host"] == victim  # the only one left
        fleet.kill(victim)
        killed = time.monotonic()
        while True:
            row = next(h for h in reader.get("/v1/fleet/hosts") if h["host"] == victim)
            if row["stale"]:
                break
            assert time.monotonic() - killed < WINDOW_S + 2.0, row
            time.sleep(0.05)
        # stale no earlier than its window after the last beat, and no later than the window after the kill
        assert row["heartbeat_age_s"] >= WINDOW_S and time.monotonic() - killed <= WINDOW_S + 2.0
        d = place(fleet, type="L40S-4Q")
        assert d["choice"] is None
        code, why = reasons(d)[victim]
        assert code == "stale" and f"its window is {WINDOW_S:g} s" in why
        rc, out, _ = cli(fleet, "fleet", "hosts", "--json")
        assert {h["host"]: h["stale"] for h in json.loads(out)}[victim] is True
        rows = {x["host"]: x for x in reader.get("/v1/fleet/capacity", type="L40S-4Q")["hosts"]}
        assert rows[victim]["stale"] and not rows[victim]["placeable"]
    finally:
        reader.post("/v1/host/uncordon", {"host": "gpu-mixed"})
        reader.post("/v1/host/uncordon", {"host": "gpu-l40s-a"})
    assert place(fleet, type="L40S-4Q")["choice"]["host"] in ("gpu-l40s-a", "gpu-mixed")


def test_the_reader_of_the_cli_is_no_fleet_member(fleet: Fleet, tmp_path: Path) -> None:
    rc, out, _ = cli(fleet, "fleet", "hosts", "--json")
    assert rc == 0 and {h["host"] for h in json.loads(out)} == set(fleet.hosts)
