"""Guest/host driver compatibility before it breaks: NVIDIA's rule over the table of branches, `guests check`
(now, and after a planned host driver) on the simulator with its exit code and one audit per finding, and the
migration preflight refusing a destination whose host driver the guest's driver falls outside."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from migration_hosts import SimHost, sim_hosts
from simhost import run

from vgpumgr.fleet.remote import Remote
from vgpumgr.nvidia import compat
from vgpumgr.nvidia import driver_window as window
from vgpumgr.sim import guests, profiles
from vgpumgr.sim.nvml import write_state

L40S = "0000:3d:00.0"


@pytest.mark.parametrize(("host", "guest", "ok"), [
    ("580.65.05", "580.65.06", True),  # the same release (manager and Linux guest differ in the last digits)
    ("580.159.01", "580.88", True),  # the same branch, another release
    ("580.65.05", "570.124.06", True),  # the previous branch
    ("580.65.05", "535.230.02", True),  # R580 is long-term: the previous long-term branch
    ("580.65.05", "550.54.15", False),  # two branches back, not long-term
    ("595.58.02", "580.65.06", True),
    ("595.58.02", "570.124.06", False),  # R595 is no long-term branch: only R580 behind it
    ("535.230.02", "470.256.02", True),  # "Supports R535, R525 and R470 guests"
    ("535.230.02", "510.108.03", False),
    ("570.124.03", "580.65.06", False),  # a guest newer than its host
    ("580.65.05", "32.0.15.8094", True),  # Windows' numbering: 580.94
    ("600.10.01", "580.65.06", None),  # a branch the table does not know
    ("580.65.05", "Not Available", None),
])
def test_nvidias_rule_over_the_branch_table(host: str, guest: str, ok: bool | None) -> None:
    verdict = window.accepts(host, guest)
    assert verdict.ok is ok, verdict.reason
    if ok is False:
        assert "R" + str(window.branch(guest)) in verdict.reason and host in verdict.reason


def test_the_window_of_each_branch() -> None:
    assert window.window(580) == (580, 570, 535)
    assert window.window(535) == (535, 525, 470)
    assert window.window(595) == (595, 580)
    assert window.window(470) == (470,)
    assert window.window(600) == ()


def test_guests_check_finds_a_guest_outside_the_window_now_and_after_a_planned_driver(tmp_path: Path) -> None:
    root = profiles.create(tmp_path / "sim", "mixed", vfs=8)
    g = ("--sysfs-root", str(root), "--state-dir", str(tmp_path / "st"), "--connect", "test:///default")

    def cli(*argv: str, rc: int = 0) -> str:
        code, out, err = run(*g, *argv)
        assert code == rc, (argv, code, out, err)
        return out

    made = json.loads(cli("vm", "create", "old", "--vgpu", "L40S-4Q", "--start", "--json"))
    vf = made["allocations"][0]["pci_address"]
    new_vf = json.loads(cli("vm", "create", "new", "--vgpu", "L40S-4Q", "--start", "--json"))["allocations"][0][
        "pci_address"]
    assert "not judged: the guest driver has not reported yet" in cli("guests", "check")
    cli("sim", "guest", "start", vf, "--driver", "550.54.15")  # R550 on the R580 host: outside
    cli("sim", "guest", "start", new_vf, "--driver", "580.65.06")
    res = json.loads(cli("guests", "check", "--json", rc=10))
    [f] = res["findings"]
    assert (f["vm"], f["guest_driver"], f["source"]) == ("old", "550.54.15", "nvml")
    assert "guest driver" in f["reason"] and res["newly_audited"] == [f["key"]]
    again = json.loads(cli("guests", "check", "--json", rc=10))
    assert again["newly_audited"] == []  # audited once per finding, not on every run
    events = [ln for ln in cli("audit", "list").splitlines() if "guest.driver.incompatible" in ln]
    assert len(events) == 1
    # after a planned host driver of R595, the R580 guest still fits, the R550 one does not
    planned = json.loads(cli("guests", "check", "--driver", "595.58.02", "--json", rc=10))
    assert [x["vm"] for x in planned["findings"]] == ["old"] and planned["findings"][0]["source"] == "rules"
    assert "R595 accepts guests of R595, R580" in cli("guests", "check", "--driver", "595.58.02", rc=10)
    # the upgrade check says the same before a host driver upgrade (issue 38's --driver)
    up = json.loads(cli("upgrade", "check", "--driver", "595.58.02", "--json", rc=10))
    guest = [f for f in up["findings"] if f["area"] == "guest"]
    assert len(guest) == 1 and guest[0]["severity"] == "block"
    assert "VM old: guest driver 550.54.15" in guest[0]["message"]
    rc, _, err = run(*g, "guests", "check", "--driver", "latest")
    assert rc != 0 and "--driver 'latest' is not an NVIDIA driver version" in err


def test_the_migration_rules_refuse_a_host_driver_the_guest_driver_falls_outside() -> None:
    vgpu = compat.MigratingVgpu("L40S-4Q", device_id="26b9", host_driver="595.58.02", guest_driver="570.124.06")
    gpu = compat.CandidateGpu(L40S, "26b9", "NVIDIA L40S", "595.58.02")
    verdict = compat.live_migration(vgpu, gpu, "NVIDIA L40S-4Q")
    assert (verdict.live, verdict.limit) == (False, compat.LIMIT_GUEST_DRIVER)
    assert "570.124.06 (R570) is outside the window" in verdict.reason
    fits = compat.MigratingVgpu("L40S-4Q", device_id="26b9", host_driver="595.58.02", guest_driver="580.65.06")
    assert compat.live_migration(fits, gpu, "NVIDIA L40S-4Q").live


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[SimHost]]:
    with sim_hosts(tmp_path, "mixed", "mixed") as hosts:
        yield hosts


def test_migration_preflight_refuses_a_destination_outside_the_guests_window(pair: list[SimHost]) -> None:
    a, b = pair
    for h in pair:  # both hosts on R595, the guest's driver R570: the source would not take it either
        path = h.server.root / ".vgpumgr-nvml.json"
        write_state(path, {**json.loads(path.read_text()), "driver_version": "595.58.02"})
    made = a.svc.create_vm("gfx", vgpus=["L40S-8Q"], start=True)
    dom_uuid = next(d["uuid"] for d in a.svc.list_vms() if d["name"] == "gfx")
    guests.start(a.server.root, made["allocations"][0]["pci_address"], vm_uuid=dom_uuid, vm_name="gfx",
                 guest_driver="570.124.06")
    report = a.svc.migrate_vm("gfx", b.uri, dest=Remote(b.api, b.operator_token), dry_run=True)
    assert not report["ok"]
    cand = report["preflight"]["vgpus"][0]["candidates"][L40S]
    assert cand["limit"] == "guest-driver" and "570.124.06 (R570) is outside the window" in cand["reason"]
