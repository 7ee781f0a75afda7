"""Live migration between simulated hosts: `vm migrate` on the source, libvirt's order played by the simulated
libvirtd (vgpumgr.sim.libvirtd), the real hook script on both sides, each host its own service and records.

What libvirtd does is simulated (the test driver cannot migrate); the proof on real daemons with a real
migratable mdev is the Debian 13 lab's (tests/lab_migration)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hookserver import LIBVIRT, run
from lxml import etree
from migration_hosts import SimHost, sim_hosts

from vgpumgr.errors import Conflict, InvalidInput, NoCapacity
from vgpumgr.fleet.remote import Remote, UnixHTTPConnection
from vgpumgr.sim import guests
from vgpumgr.sim.libvirtd import FAIL_ENV
from vgpumgr.sim.nvml import write_state
from vgpumgr.virt import domain
from vgpumgr.virt import migration_xml as migration

T4 = "0000:3b:00.0"
L40S = "0000:3d:00.0"
VF1 = "0000:3d:00.4"


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[SimHost]]:
    with sim_hosts(tmp_path, "mixed", "mixed") as hosts:
        yield hosts


def remote(h: SimHost) -> Remote:
    return Remote(h.api, h.operator_token)


def state(*hosts: SimHost) -> list[object]:
    """Everything a refused migration must leave as it was: records, devices, domains."""
    return [(sorted((a["vm"], a.get("uuid") or a["pci_address"], a["state"]) for a in h.live()), h.devices(),
             h.domains()) for h in hosts]


def test_an_mdev_vm_moves_keeping_its_uuid_and_both_audit_logs_tell_it(pair: list[SimHost]) -> None:
    a, b = pair
    made = a.svc.create_vm("web1", vgpus=["T4-4Q"], start=True)
    uuid = made["allocations"][0]["uuid"]
    seen: list[dict[str, object]] = []

    res = a.svc.migrate_vm("web1", b.uri, dest=remote(b), progress=seen.append)

    assert res["ok"] and res["released"] == [uuid] and res["settled"]
    assert seen and seen[-1]["data_remaining"] == 0  # the progress bar's feed, from the job statistics
    assert a.live("web1") == [] and uuid not in a.server.mdevs()
    [there] = b.live("web1")
    assert there["uuid"] == uuid and there["state"] == "active" and "incoming" not in there  # settled
    assert b.server.mdevs()[uuid][0] == T4
    assert b.domains()["web1"] == "running" and "web1" not in a.domains()
    mid = res["migration"]
    assert [e.detail["migration"] for e in a.events("vm.migrate")][-1] == mid
    assert {e.detail["migration"] for e in b.events("vgpu.incoming")} >= {mid}
    assert [e.detail["migration"] for e in b.events("vm.migrated-in")][-1] == mid
    # the domain's XML at the destination names the vGPU it got there
    with b.svc.virt() as v:
        assert domain.referenced_devices(v.xml("web1"))["mdev"] == [uuid]


def test_a_vendor_vf_taken_at_the_destination_becomes_another_vf(pair: list[SimHost]) -> None:
    a, b = pair
    b.svc.allocate("L40S-2Q", vm="squatter", policy=_pin(VF1))
    a.svc.create_vm("cad1", vgpus=["L40S-2Q"], start=True)
    [src] = a.live("cad1")
    assert src["pci_address"] == VF1

    a.svc.migrate_vm("cad1", b.uri, dest=remote(b))

    [there] = b.live("cad1")
    assert there["pci_address"] not in (VF1, None) and there["type"] == src["type"]
    assert b.server.vf_types()[there["pci_address"]] == src["type"] and b.server.vf_types()[VF1] == src["type"]
    assert VF1 not in a.server.vf_types()
    with b.svc.virt() as v:
        assert there["pci_address"] in domain.referenced_devices(v.xml("cad1"))["pci"]


def test_a_mig_backed_and_a_two_vgpu_vm_move(pair: list[SimHost]) -> None:
    a, b = pair
    a.svc.create_vm("ml1", mig=["1g.10gb"], start=True)
    a.svc.create_vm("duo", vgpus=["T4-2Q", "L40S-4Q"], start=True)
    a.svc.migrate_vm("ml1", b.uri, dest=remote(b))
    a.svc.migrate_vm("duo", b.uri, dest=remote(b))
    [ml] = b.live("ml1")
    assert ml["mig_profile"] == "1g.10gb" and ml["state"] == "active"
    assert sorted(x["type_name"].split()[-1] for x in b.live("duo")) == ["L40S-4Q", "T4-2Q"]
    assert a.live("ml1") == [] and a.live("duo") == []


def test_a_full_destination_refuses_before_anything_moves(pair: list[SimHost], tmp_path: Path) -> None:
    a, b = pair
    a.svc.create_vm("big", vgpus=["T4-16Q"], start=True)
    b.svc.allocate("T4-16Q", vm="filler")  # the destination's one T4 is full now
    before = state(a, b)
    report = a.svc.migrate_vm("big", b.uri, dest=remote(b), dry_run=True)
    assert not report["ok"] and "T4-16Q" in report["refusals"][0]
    with pytest.raises(Conflict, match="cannot take VM big"):
        a.svc.migrate_vm("big", b.uri, dest=remote(b))
    # without the preflight, the destination's hook refuses at `migrate begin`: libvirt cancels
    with pytest.raises(Conflict, match="migrate begin"):
        a.svc.migrate_vm("big", b.uri)
    assert state(a, b) == before
    assert a.domains()["big"] == "running"


def test_a_failed_transfer_leaves_the_vm_at_the_source_and_nothing_at_the_destination(
        pair: list[SimHost], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair
    a.svc.create_vm("flaky", vgpus=["T4-1Q"], start=True)
    before = state(a, b)
    monkeypatch.setenv(FAIL_ENV, "transfer")
    with pytest.raises(Exception, match="transfer"):
        a.svc.migrate_vm("flaky", b.uri, dest=remote(b))
    assert state(a, b) == before and a.domains()["flaky"] == "running"
    failed = [e for e in a.events("vm.migrate") if e.outcome == "failed"]
    assert failed and failed[-1].vm == "flaky"


def test_the_destination_refuses_what_cannot_move_live(pair: list[SimHost]) -> None:
    a, b = pair
    before = state(b)
    whole = _xml("pt1", domain.Hostdev("passthrough", address=T4), None)
    r = run([str(LIBVIRT), "pt1", "migrate", "begin", "-"], b.server.env(), whole)
    assert r.returncode != 0 and "whole GPU" in r.stderr and r.stdout == ""
    # a vGPU from another board (an L40, 10de:26b5) may not continue on the L40S here
    other_board = _xml("x1", domain.Hostdev("nvidia-vf", address=VF1),
                       {"pci_address": VF1, "backend": "nvidia-vf", "type": "nvidia-1148",
                        "type_name": "NVIDIA L40S-2Q",
                        migration.MIGRATION_KEY: {"device_id": "26b5", "gpu_name": "NVIDIA L40", "id": "t1"}})
    r = run([str(LIBVIRT), "x1", "migrate", "begin", "-"], b.server.env(), other_board)
    assert r.returncode != 0 and "another board" in r.stderr
    # a vGPU manager of another version
    other_driver = _xml("x2", domain.Hostdev("nvidia-vf", address=VF1),
                        {"pci_address": VF1, "backend": "nvidia-vf", "type": "nvidia-1148",
                         "type_name": "NVIDIA L40S-2Q", migration.MIGRATION_KEY: {"host_driver": "535.230.02"}})
    r = run([str(LIBVIRT), "x2", "migrate", "begin", "-"], b.server.env(), other_driver)
    assert r.returncode != 0 and "vGPU manager differs" in r.stderr
    assert state(b) == before


def test_nvml_decides_where_the_guest_runs_and_a_newer_vgpu_manager_is_refused(pair: list[SimHost]) -> None:
    a, b = pair
    made = a.svc.create_vm("gfx", vgpus=["L40S-8Q"], start=True)
    vf = made["allocations"][0]["pci_address"]
    dom_uuid = next(d["uuid"] for d in a.svc.list_vms() if d["name"] == "gfx")
    guests.start(a.server.root, vf, vm_uuid=dom_uuid, vm_name="gfx", guest_driver="580.95.05")
    nvml_state = b.server.root / ".vgpumgr-nvml.json"
    saved = nvml_state.read_text()
    st = json.loads(saved)
    st["driver_version"] = "590.10.01"
    write_state(nvml_state, st)
    try:
        report = a.svc.migrate_vm("gfx", b.uri, dest=remote(b), dry_run=True)
        assert not report["ok"]
        cands = report["preflight"]["vgpus"][0]["candidates"]
        assert cands[L40S]["source"] == "nvml" and cands[L40S]["limit"] == "host-driver"
    finally:
        write_state(nvml_state, json.loads(saved))
    res = a.svc.migrate_vm("gfx", b.uri, dest=remote(b))
    assert res["vgpus"][0]["nvml"] == "ok"
    # the guest runs on at the destination: NVML there reports its vGPU for the same domain
    [inst] = [i for i in guests.running(b.server.root) if i["vm_uuid"] == dom_uuid]
    assert inst["vf"] == b.live("gfx")[0]["pci_address"]


def test_the_cli_dry_run_names_each_refusal(pair: list[SimHost]) -> None:
    from simhost import run as cli

    a, b = pair
    a.svc.create_vm("cli1", vgpus=["T4-16Q"], start=True)
    b.svc.allocate("T4-16Q", vm="filler")  # the destination's one T4 is full
    args = ("--sysfs-root", str(a.server.root), "--state-dir", str(a.server.cfg.state_dir),
            "--connect", a.server.cfg.libvirt_uri)
    import os

    os.environ["VGPUMGR_TO_TOKEN"] = b.operator_token
    os.environ["VGPUMGR_HOSTNAME"] = a.name
    try:
        rc, out, err = cli(*args, "vm", "migrate", "cli1", "--to", b.uri, "--to-api", b.api, "--dry-run")
        rc_json, out_json, _ = cli(*args, "vm", "migrate", "cli1", "--to", b.uri, "--to-api", b.api, "--dry-run",
                                   "--json")
    finally:
        del os.environ["VGPUMGR_TO_TOKEN"], os.environ["VGPUMGR_HOSTNAME"]
    assert rc == 4, (out, err)
    assert "refused:" in out and "T4-16Q" in out and "would be refused" in out
    assert rc_json == 4 and json.loads(out_json)["refusals"]


def _pin(parent: str):  # noqa: ANN202
    from vgpumgr.placement.placer import Policy

    return Policy(pin_parent=parent)


def _xml(name: str, hostdev: domain.Hostdev, record: dict[str, object] | None) -> str:
    d = domain.build(domain.VmSpec(name, hostdevs=[hostdev]))
    if record:
        d.set_allocations([record])
    return etree.tostring(d.element, encoding="unicode")


def test_a_host_without_room_says_so_in_the_hooks_words(pair: list[SimHost]) -> None:
    """The refusal reaches libvirt as the hook's stderr: what placement said, per GPU."""
    _, b = pair
    b.svc.allocate("T4-16Q", vm="filler")
    xml = _xml("nope", domain.Hostdev("mdev", uuid="9d2e8a44-5b1c-4d7e-8f00-000000000001"),
               {"uuid": "9d2e8a44-5b1c-4d7e-8f00-000000000001", "backend": "mdev", "type": "nvidia-230",
                "type_name": "GRID T4-16Q"})
    r = run([str(LIBVIRT), "nope", "migrate", "begin", "-"], b.server.env(), xml)
    assert r.returncode == 1 and "T4-16Q" in r.stderr and not r.stdout
    with pytest.raises(NoCapacity):
        b.svc.libvirt_migrate("nope", xml)


def test_a_device_made_here_by_someone_else_is_left_as_it_is(pair: list[SimHost]) -> None:
    """An incoming hostdev without vgpumgr's record: one that exists here (made beforehand, as Nova and KubeVirt
    do) passes unchanged; one that does not is refused with what is missing. Nothing is reserved either way."""
    from vgpumgr.backends import mdev as mdev_backend

    _, b = pair
    made = "9d2e8a44-5b1c-4d7e-8f00-0000000000aa"
    mdev_backend.create(b.svc.host, T4, "nvidia-230", made)
    res = b.svc.libvirt_migrate("theirs", _xml("theirs", domain.Hostdev("mdev", uuid=made), None))
    assert res["xml"] is None and res["vgpus"] == [] and b.live() == []
    missing = "9d2e8a44-5b1c-4d7e-8f00-0000000000bb"
    with pytest.raises(InvalidInput, match="carries no vgpumgr record"):
        b.svc.libvirt_migrate("theirs", _xml("theirs", domain.Hostdev("mdev", uuid=missing), None))
    assert b.live() == [] and not b.svc.host.mdev(missing).exists()


def test_the_persistent_definition_is_pointed_at_the_destinations_vgpus() -> None:
    old = "9d2e8a44-5b1c-4d7e-8f00-00000000000a"
    new = "9d2e8a44-5b1c-4d7e-8f00-00000000000b"
    inactive = _xml("p1", domain.Hostdev("mdev", uuid=old), {"uuid": old, "backend": "mdev", "type": "nvidia-222"})
    live = _xml("p1", domain.Hostdev("mdev", uuid=new), {"uuid": new, "backend": "mdev", "type": "nvidia-222"})
    fixed = migration.persistent_fix(inactive, live)
    assert fixed is not None and domain.referenced_devices(fixed)["mdev"] == [new]
    assert [r["uuid"] for r in domain.read_allocations(fixed)] == [new]
    assert migration.persistent_fix(live, live) is None


def _seats(h: SimHost) -> list[tuple[str, str]]:
    from vgpumgr.db.session import session_factory
    from vgpumgr.licensing import seats as licensing

    with session_factory(h.server.cfg.db_url)() as s:
        return [(x.host, x.vm) for u in licensing.usage(s) for x in u.holders]


def _pool(h: SimHost, seats: int) -> None:
    from vgpumgr.db.session import session_factory
    from vgpumgr.licensing import seats as licensing

    with session_factory(h.server.cfg.db_url).begin() as s:
        licensing.add_pool(s, name=f"vws-{h.name}", edition_name="vWS", seats=seats)


def test_on_a_shared_database_the_seat_moves_with_the_vm_even_from_a_full_pool(
        tmp_path: Path, pg_server: object) -> None:
    url = pg_server.create_database()  # type: ignore[attr-defined]
    with sim_hosts(tmp_path, "mixed", "mixed", licence_mode="enforce", db=url) as (a, b):
        _pool(a, 1)  # one seat, for the whole fleet
        a.svc.create_vm("cad9", vgpus=["L40S-2Q"], start=True)
        assert _seats(a) == [("host-a", "cad9")]
        with pytest.raises(Exception, match="licence seat"):
            b.svc.allocate("L40S-2Q", vm="other")  # the pool is full
        res = a.svc.migrate_vm("cad9", b.uri, dest=remote(b))
        assert res["ok"]
        assert _seats(a) == [("host-b", "cad9")]  # the same seat, now held by the VM on host-b
        assert b.live("cad9")[0]["licence"] == "vWS" and a.live("cad9") == []


def test_a_destination_without_a_free_seat_refuses(tmp_path: Path) -> None:
    with sim_hosts(tmp_path, "mixed", "mixed", licence_mode="enforce") as (a, b):
        _pool(a, 1)
        _pool(b, 1)
        a.svc.create_vm("cad8", vgpus=["L40S-2Q"], start=True)
        b.svc.create_vm("local", vgpus=["L40S-2Q"])  # takes host-b's only seat
        before = state(a, b)
        with pytest.raises(Conflict, match="licence seat"):
            a.svc.migrate_vm("cad8", b.uri)
        assert state(a, b) == before


def test_rest_migrates_and_offline_moves_a_shut_off_vm(pair: list[SimHost]) -> None:
    a, b = pair
    a.svc.create_vm("rest1", vgpus=["T4-2Q"], start=True)
    a.svc.create_vm("cold1", vgpus=["T4-2Q"])  # defined, shut off

    def post(path: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
        c = UnixHTTPConnection(str(a.server.sock), timeout=120)
        c.request("POST", path, json.dumps(body), {"Authorization": f"Bearer {a.operator_token}",
                                                   "Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())

    status, body = post("/v1/vms/rest1/migrate", {"to": b.uri, "to_api": b.api, "to_token": b.operator_token})
    assert status == 200 and body["ok"], body
    status, body = post("/v1/vms/cold1/migrate", {"to": b.uri})
    assert status == 409 and "shut off" not in str(body) and "running VM" in str(body)
    status, body = post("/v1/vms/cold1/migrate", {"to": b.uri, "offline": True, "to_api": b.api,
                                                  "to_token": b.operator_token})
    assert status == 200, body
    assert b.domains()["cold1"] == "shutoff" and b.domains()["rest1"] == "running"
    assert [x["state"] for x in b.live("cold1")] == ["active"] and a.live("cold1") == []


def test_drain_cordons_and_moves_each_vm_to_the_first_host_that_can_take_it(tmp_path: Path) -> None:
    from simhost import run as cli

    with sim_hosts(tmp_path, "mixed", "mixed", "mixed") as (a, b, c):
        for vm in ("d1", "d2"):
            a.svc.create_vm(vm, vgpus=["T4-4Q"], start=True)
        a.svc.create_vm("idle", vgpus=["T4-4Q"])  # shut off: not drained (it runs nowhere)
        c.svc.cordon_host(reason="fan")  # a cordoned destination takes no incoming VM
        for n in range(3):
            b.svc.allocate("T4-4Q", vm=f"filler{n}")  # host-b has room for one more T4-4Q
        import os

        files = []
        for h in (c, b):
            files += ["--to-token-file", str(tmp_path / f"{h.name}.token")]
            (tmp_path / f"{h.name}.token").write_text(h.operator_token + "\n")
        os.environ["VGPUMGR_HOSTNAME"] = a.name
        try:
            rc, out, err = cli("--sysfs-root", str(a.server.root), "--state-dir", str(a.server.cfg.state_dir),
                               "--connect", a.server.cfg.libvirt_uri, "host", "drain", "--to", c.uri, "--to", b.uri,
                               "--to-api", c.api, "--to-api", b.api, *files, "--json")
        finally:
            del os.environ["VGPUMGR_HOSTNAME"]
        res = json.loads(out)
        assert rc == 4 and res["cordoned"]
        assert [m["to"] for m in res["moved"]] == [b.uri]
        [stayed] = res["stayed"]
        # host-c is cordoned; host-b is full after the first VM
        assert "cordoned" in stayed["reasons"][c.uri] and "T4-4Q" in stayed["reasons"][b.uri]
        assert a.svc.host_status()["cordoned"] and a.svc.host_status()["reason"] == "draining"
        assert sorted(d for d, st in a.domains().items() if st == "running") == [stayed["vm"]]
        assert b.domains()[res["moved"][0]["vm"]] == "running" and "idle" in a.domains()
        assert c.live() == []


def test_drain_without_destinations_asks_the_fleet_for_each_vm(tmp_path: Path, pg_server: object) -> None:
    url = pg_server.create_database()  # type: ignore[attr-defined]
    # the services' own heartbeats stay off: each host publishes here, at its simulated libvirtd's URI
    with sim_hosts(tmp_path, "mixed", "mixed", "mixed", db=url, env_extra={"VGPUMGR_FLEET_PUBLISH": "0"}) as hosts:
        a, b, c = hosts
        for vm in ("d1", "d2"):
            a.svc.create_vm(vm, vgpus=["T4-4Q"], start=True)
        for n in range(3):
            b.svc.allocate("T4-4Q", vm=f"filler{n}")  # host-b has room for one more T4-4Q
        c.svc.cordon_host(reason="fan")
        for h in hosts:
            h.svc.fleet.migration_uri = h.uri
            h.svc.publish_fleet()
        res = a.svc.drain_host(None)
        assert [(m["vm"], m["to"]) for m in res["moved"]] == [("d1", b.uri)]
        [stayed] = res["stayed"]
        # the fleet passed over the cordoned host-c; host-b's own placement refused the VM its published
        # counts (written before d1 arrived) still offered
        assert stayed["vm"] == "d2" and "cordoned" in stayed["reasons"]["host-c"]
        assert "T4-4Q" in stayed["reasons"][b.uri]
        assert b.domains()["d1"] == "running" and a.domains()["d2"] == "running"
        assert [x["state"] for x in b.live("d1")] == ["active"] and c.live() == []


def test_drain_with_no_destination_and_no_fleet_says_what_to_give(pair: list[SimHost],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from simhost import run as cli

    a, _ = pair
    monkeypatch.setenv("VGPUMGR_HOSTNAME", a.name)  # its own database: only host-a itself has published there
    where = ("--sysfs-root", str(a.server.root), "--state-dir", str(a.server.cfg.state_dir),
             "--connect", a.server.cfg.libvirt_uri)
    rc, out, err = cli(*where, "host", "drain")  # nothing runs here: the drain is the cordon alone
    assert rc == 0 and a.svc.host_status()["cordoned"], err
    assert cli(*where, "host", "uncordon")[0] == 0
    a.svc.create_vm("web1", vgpus=["T4-4Q"], start=True)
    rc, out, err = cli(*where, "host", "drain")
    assert rc == 2 and "no destination to drain to" in err and "--to URI" in err
    assert not a.svc.host_status()["cordoned"]  # refused before the cordon
