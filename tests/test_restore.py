"""`vgpumgr restore` after a reboot, on every simulator profile; idempotence, dry run, what is in the way,
the audit trail, and the boot profile of a Nova compute node."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from simhost import run

from vgpumgr.audit import chain as audit
from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.backends import nvidia_vf
from vgpumgr.config import Config
from vgpumgr.discovery.fs import read_int
from vgpumgr.discovery.mdev import discover_mdevs
from vgpumgr.discovery.nvidia_vf import discover_vf_vgpus
from vgpumgr.errors import InvalidInput
from vgpumgr.service import Service
from vgpumgr.sim import profiles
from vgpumgr.sim.reboot import reboot as sim_reboot


def make_service(tmp_path: Path, profile: str, **kw: object) -> Service:
    root = profiles.create(tmp_path / "sim", profile, **kw)
    cfg = Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "state"), connect="test:///default")
    return Service(cfg, licence_mode="off")


def real_reboot(svc: Service) -> None:
    """What a host reboot takes away (the simulator's faithful reboot): VFs, VF types, mdevs, GPU instances,
    and MIG mode on Hopper."""
    sim_reboot(svc.host.root)
    svc.invalidate()


def host_state(svc: Service) -> dict[str, Any]:
    host = svc.host
    numvfs = {p.name: read_int(f"{p}/sriov_numvfs") for p in host.pci_devices.iterdir()
              if (p / "sriov_numvfs").exists()}
    mig: dict[str, Any] = {}
    if (host.root / ".vgpumgr-nvml.json").exists():
        for addr, g in svc.nvml().gpus().items():
            m = g.get("mig") or {}
            mig[addr] = (m.get("current"), sorted((gi["profile"], gi["start"], gi["size"])
                                                  for gi in m.get("gpu_instances", [])))
    return {"mdevs": sorted((m.uuid, m.parent, m.type) for m in discover_mdevs(host)),
            "vf_types": sorted((v.address, v.type) for v in discover_vf_vgpus(host)),
            "numvfs": numvfs, "mig": mig}


# what each profile runs before the reboot: (type or "mig:<profile>", VM)
WORKLOADS = {
    "t4": [("T4-4Q", "a"), ("T4-4Q", "b")],
    "a40-sriov": [("A40-4Q", "a"), ("A40-4Q", "b")],
    "l40s-vfio": [("L40S-2Q", "a"), ("L40S-2Q", "b")],
    "a100-mig": [("mig:3g.40gb", "a"), ("mig:1g.10gb", "b")],
    "h100-mig": [("mig:2g.20gb", "a"), ("mig:1g.10gb", "b")],
    "mixed": [("T4-4Q", "a"), ("L40S-2Q", "b"), ("mig:1g.10gb", "c")],
}


def run_workload(svc: Service, profile: str) -> None:
    for what, vm in WORKLOADS[profile]:
        if what.startswith("mig:"):
            svc.allocate_mig(what[4:], vm=vm)
        else:
            svc.allocate(what, vm=vm)


def statuses(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(st["step"], st["target"], st["status"]) for g in result["gpus"] for st in g["steps"]]


@pytest.mark.parametrize("profile", sorted(WORKLOADS))
def test_restore_brings_back_what_a_reboot_took(tmp_path: Path, profile: str) -> None:
    svc = make_service(tmp_path, profile, vfs=4)
    run_workload(svc, profile)
    before = host_state(svc)
    assert before["mdevs"] or before["vf_types"]
    real_reboot(svc)
    after_reboot = host_state(svc)
    assert after_reboot["mdevs"] == [] and after_reboot["vf_types"] == []
    assert after_reboot != before

    first = svc.restore()
    assert host_state(svc) == before  # same UUIDs, VF counts, types, GI placements, MIG mode
    assert first["counts"].get("done", 0) > 0
    assert not {"failed", "blocked", "pending"} & set(first["counts"]), statuses(first)

    second = svc.restore()  # idempotent: everything is in place, nothing changes
    assert set(second["counts"]) == {"ok"}, statuses(second)
    assert host_state(svc) == before


def test_records_hold_vfs_per_pf_and_gi_placements(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "h100-mig", vfs=6)
    svc.allocate_mig("2g.20gb", vm="a")
    want = svc.restore(dry_run=True)
    steps = {st["step"]: st for st in want["gpus"][0]["steps"]}
    assert steps["vfs"]["numvfs"] == 6 and steps["vfs"]["status"] == "ok"
    gi = next(g for g in svc.nvml().gpus()["0000:19:00.0"]["mig"]["gpu_instances"])
    assert steps["gpu-instance"]["target"] == f"0000:19:00.0@{gi['start']}"


def test_h100_mig_mode_is_turned_on_again_and_audited(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "h100-mig", vfs=4)
    svc.allocate_mig("1g.10gb", vm="a")
    real_reboot(svc)
    assert svc.nvml().gpus()["0000:19:00.0"]["mig"]["current"] == "disabled"
    r = svc.restore(actor="boot")
    kinds = [(st["step"], st["status"]) for st in r["gpus"][0]["steps"]]
    assert kinds == [("vfs", "done"), ("mig-mode", "done"), ("gpu-instance", "done"), ("vf-type", "done")]
    with svc.sessions() as s:
        ev = [(e.action, e.outcome, e.actor) for e in audit.query(s) if e.action.startswith("restore")]
        assert audit.verify(s).ok
    assert ev == [("restore.vfs", "ok", "boot"), ("restore.mig-mode", "ok", "boot"),
                  ("restore.gpu-instance", "ok", "boot"), ("restore.vf-type", "ok", "boot"), ("restore", "ok", "boot")]


def test_a_pending_mig_mode_is_reported_and_the_gpu_never_reset(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "a100-mig", vfs=4)
    svc.allocate_mig("1g.10gb", vm="a")
    real_reboot(svc)
    layer = svc.nvml()
    layer.set_mig_mode("0000:65:00.0", False)  # Ampere: pending until a reset
    layer.nvml.reset_gpu("0000:65:00.0")
    svc.host.kernel.gpu_instances_changed(layer)
    r = svc.restore()
    st = {s["step"]: s["status"] for s in r["gpus"][0]["steps"]}
    assert st["mig-mode"] == "pending" and st["gpu-instance"] == "skipped"
    assert svc.nvml().gpus()["0000:65:00.0"]["mig"]["current"] == "disabled"  # no reset happened
    assert svc.nvml().gpus()["0000:65:00.0"]["mig"]["pending"] == "enabled"
    again = svc.restore()
    assert {s["step"]: s["status"] for s in again["gpus"][0]["steps"]}["mig-mode"] == "pending"
    svc.nvml().nvml.reset_gpu("0000:65:00.0")  # the operator's reset
    svc.host.kernel.gpu_instances_changed(svc.nvml())
    done = svc.restore()
    assert not {"failed", "blocked", "pending", "skipped"} & set(done["counts"]), statuses(done)


def test_dry_run_changes_nothing_and_says_what_it_would_do(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "mixed", vfs=4)
    run_workload(svc, "mixed")
    real_reboot(svc)
    lost = host_state(svc)
    with svc.sessions() as s:
        n_events = len(audit.query(s))
    r = svc.restore(dry_run=True)
    assert r["dry_run"] and host_state(svc) == lost
    assert {"planned"} <= set(r["counts"]) and not {"done", "failed"} & set(r["counts"])
    planned = {(st["step"], st["target"]) for g in r["gpus"] for st in g["steps"] if st["status"] == "planned"}
    real = svc.restore()
    done = {(st["step"], st["target"]) for g in real["gpus"] for st in g["steps"] if st["status"] == "done"}
    assert planned == done
    with svc.sessions() as s:
        assert len(audit.query(s)) > n_events


def test_a_vf_with_another_type_is_reported_and_replaced_only_with_force(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "l40s-vfio", vfs=4)
    a = svc.allocate("L40S-2Q", vm="a")
    real_reboot(svc)
    host = svc.host
    host.write(host.pci("0000:3d:00.0") / "sriov_numvfs", "4")
    other = next(i for i, name in nvidia_vf.creatable(host, a["pci_address"]) if name.endswith("-4Q"))
    nvidia_vf.set_type(host, a["pci_address"], other)
    r = svc.restore()
    assert ("remove", a["pci_address"], "blocked") in statuses(r)
    assert nvidia_vf.current(host, a["pci_address"]) == other
    rc, out, err = run("--sysfs-root", str(host.root), "--state-dir", str(svc.cfg.state_dir), "restore")
    assert rc == 4 and "blocked" in out and "--force" in out
    forced = svc.restore(force=True)
    assert ("remove", a["pci_address"], "done") in statuses(forced)
    assert f"nvidia-{nvidia_vf.current(host, a['pci_address'])}" == a["type"]


def test_unknown_mdevs_are_left_alone_unless_they_take_the_room_or_force(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "t4")
    a = svc.allocate("T4-4Q", vm="a")
    real_reboot(svc)
    host = svc.host
    stranger = mdev_backend.create(host, "0000:3b:00.0", "nvidia-232").uuid
    r = svc.restore()  # room for both: the stranger is only reported
    assert ("remove", stranger, "unknown") in statuses(r) and ("mdev", a["uuid"], "done") in statuses(r)
    assert {m.uuid for m in discover_mdevs(host)} == {a["uuid"], stranger}

    real_reboot(svc)
    strangers = [mdev_backend.create(host, "0000:3b:00.0", "nvidia-232").uuid for _ in range(4)]  # T4-4Q: 4 fit
    r = svc.restore()
    assert ("mdev", a["uuid"], "blocked") in statuses(r)
    assert {m.uuid for m in discover_mdevs(host)} == set(strangers)  # nothing removed without --force
    r = svc.restore(force=True)
    assert [(s, t) for s, t, st in statuses(r) if st == "done"] == [("remove", u) for u in sorted(strangers)] + \
        [("mdev", a["uuid"])]
    assert {m.uuid for m in discover_mdevs(host)} == {a["uuid"]}


def test_mdevs_on_virtual_parents_come_back_too(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "samples")
    a = svc.allocate("mtty-2", vm="a")
    real_reboot(svc)
    assert discover_mdevs(svc.host) == []
    r = svc.restore()
    assert statuses(r) == [("mdev", a["uuid"], "done")]
    assert [(m.uuid, m.parent) for m in discover_mdevs(svc.host)] == [(a["uuid"], "mtty")]


def test_only_recorded_gpus_are_touched(tmp_path: Path) -> None:
    from vgpumgr.sim.host_platform import break_state

    svc = make_service(tmp_path, "mixed", vfs=4)
    break_state(svc.host.root, "vfs-off", "0000:65:00.0")  # the A100's VFs were off when vgpumgr looked
    svc.invalidate()
    svc.allocate("T4-4Q", vm="a")
    real_reboot(svc)
    r = svc.restore(force=True)
    # issue 38: the L40S's enabled VFs were recorded at the allocation although no vGPU was on them
    assert [g["gpu"] for g in r["gpus"]] == ["0000:3b:00.0", "0000:3d:00.0"]
    assert read_int(f"{svc.host.pci('0000:3d:00.0')}/sriov_numvfs") == 4
    assert read_int(f"{svc.host.pci('0000:65:00.0')}/sriov_numvfs") == 0  # the A100 had nothing recorded


def test_cli_json_report_with_progress_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svc = make_service(tmp_path, "l40s-vfio", vfs=2)
    svc.allocate("L40S-2Q", vm="a")
    real_reboot(svc)
    base = ("--sysfs-root", str(svc.host.root), "--state-dir", str(svc.cfg.state_dir))
    capsys.readouterr()
    rc, out, _ = run(*base, "restore", "--dry-run", "--json")
    assert rc == 0 and json.loads(out)["dry_run"] is True
    assert "0000:3d:00.0: 2 planned" in capsys.readouterr().err
    rc, out, _ = run(*base, "restore", "--json")
    assert rc == 0 and json.loads(out)["counts"] == {"done": 2} and "0000:3d:00.0: 2 done" in capsys.readouterr().err
    rc, out, _ = run(*base, "restore")
    assert rc == 0 and "restore: 2 ok" in out


# -- the boot profile of a Nova compute node ---------------------------------------------------------------

PROFILE = """
[[gpu]]
address = "0000:3d:00.0"
vfs = 4
vf = [
  {address = "0000:3d:00.4", type = "L40S-4Q"},
  {address = "0000:3d:00.5", type = "nvidia-1150", resource_class = "CUSTOM_L40S_4Q", alias = "l40s-4q"},
]
"""


def test_profile_restore_enables_vfs_and_sets_types_before_nova_starts(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "l40s-vfio", vfs=0)
    path = tmp_path / "profile.toml"
    path.write_text(PROFILE)
    base = ("--sysfs-root", str(svc.host.root), "--state-dir", str(svc.cfg.state_dir))
    rc, out, err = run(*base, "profile", "check", str(path))
    assert (rc, err) == (0, "") and "fits this host" in out
    rc, out, err = run(*base, "restore", "--profile", str(path))
    assert rc == 0, out + err
    vfs = dict((v.address, v.type) for v in discover_vf_vgpus(svc.host))
    assert read_int(f"{svc.host.pci('0000:3d:00.0')}/sriov_numvfs") == 4
    assert vfs == {"0000:3d:00.4": "nvidia-1150", "0000:3d:00.5": "nvidia-1150"}
    rc, out, _ = run(*base, "profile", "apply", str(path), "--json")
    assert rc == 0 and json.loads(out)["counts"] == {"ok": 3}
    real_reboot(svc)
    rc, out, _ = run(*base, "profile", "apply", str(path))
    assert rc == 0 and "3 done" in out


def test_nova_lines_name_each_vf_unmanaged_and_a_type_vf_alias(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "l40s-vfio", vfs=0)
    path = tmp_path / "profile.toml"
    path.write_text(PROFILE)
    rc, out, _ = run("--sysfs-root", str(svc.host.root), "profile", "nova", str(path))
    assert rc == 0
    specs = [json.loads(line.split(" = ", 1)[1]) for line in out.splitlines() if line.startswith("device_spec = ")]
    aliases = [json.loads(line.split(" = ", 1)[1]) for line in out.splitlines() if line.startswith("alias = ")]
    assert specs == [
        {"vendor_id": "10de", "product_id": "26b9", "address": "0000:3d:00.4",
         "resource_class": "CUSTOM_NVIDIA_L40S_4Q", "managed": "no"},
        {"vendor_id": "10de", "product_id": "26b9", "address": "0000:3d:00.5", "resource_class": "CUSTOM_L40S_4Q",
         "managed": "no"}]
    assert aliases == [{"name": "vgpu-l40s-4q", "device_type": "type-VF", "resource_class": "CUSTOM_NVIDIA_L40S_4Q"},
                       {"name": "l40s-4q", "device_type": "type-VF", "resource_class": "CUSTOM_L40S_4Q"}]
    assert "report_in_placement = True" in out and "pci_in_placement = True" in out


def test_profile_with_mig_gpu_instances_and_json_format(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "h100-mig", vfs=0)
    layer = svc.nvml()
    layer.set_mig_mode("0000:19:00.0", False)
    svc.host.kernel.gpu_instances_changed(layer)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"gpu": [{"address": "0000:19:00.0", "vfs": 2, "gpu_instance": [
        {"profile": "3g.40gb", "start": 4}, {"profile": "1g.10gb", "start": 0}],
        "vf": [{"address": "0000:19:00.4", "type": "H100XM-3-40C"}]}]}))
    rc, out, err = run("--sysfs-root", str(svc.host.root), "--state-dir", str(svc.cfg.state_dir),
                       "restore", "--profile", str(path))
    assert rc == 0, out + err
    m = svc.nvml().gpus()["0000:19:00.0"]["mig"]
    assert m["current"] == "enabled"
    assert sorted((g["profile"], g["start"]) for g in m["gpu_instances"]) == [("1g.10gb", 0), ("3g.40gb", 4)]
    assert [(v.address, v.name) for v in discover_vf_vgpus(svc.host, {1134: "H100XM-3-40C"})] == \
        [("0000:19:00.4", "H100XM-3-40C")]


@pytest.mark.parametrize(("text", "problem"), [
    ('[[gpu]]\naddress = "0000:3d:00.0"\nvfs = 2\nvf = [{address = "0000:3d:00.7", type = "L40S-4Q"}]\n',
     "0000:3d:00.7 is VF 3 of 0000:3d:00.0, which gets only 2 VFs"),
    ('[[gpu]]\naddress = "0000:3d:00.0"\nvfs = 64\n', "64 VFs asked for, it offers 32"),
    ('[[gpu]]\naddress = "0000:3b:00.0"\nvfs = 2\n', "not an SR-IOV physical function"),
])
def test_profile_check_names_what_does_not_fit(tmp_path: Path, text: str, problem: str) -> None:
    svc = make_service(tmp_path, "mixed", vfs=0)
    path = tmp_path / "p.toml"
    path.write_text(text)
    rc, out, err = run("--sysfs-root", str(svc.host.root), "--state-dir", str(svc.cfg.state_dir),
                       "profile", "check", str(path))
    assert rc == 2 and problem in err


@pytest.mark.parametrize(("text", "message"), [
    ('[[gpu]]\naddress = "0000:3d:00.0"\nvfz = 2\n', "unknown key(s) vfz"),
    ('[[gpu]]\naddress = "nope"\n', "'nope' is not a PCI address"),
    ('[[gpu]]\naddress = "0000:3d:00.0"\nvf = [{address = "0000:3d:00.4", type = "X", resource_class = "L40S"}]\n',
     "is not a custom resource class"),
    ('[[gpu]]\naddress = "0000:3d:00.0"\nvfs = -1\n', "must be a whole number"),
    ('[[gpu]]\naddress = "0000:3d:00.0"\n[[gpu]]\naddress = "0000:3d:00.0"\n', "appears twice"),
    ("[gpu\n", "is not valid TOML"),
])
def test_bad_profiles_are_refused_with_the_reason(tmp_path: Path, text: str, message: str) -> None:
    from vgpumgr.platforms.boot_profile import load

    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(InvalidInput) as e:
        load(path)
    assert message in e.value.message


def test_a_profile_that_contradicts_the_records_is_refused_before_anything_changes(tmp_path: Path) -> None:
    svc = make_service(tmp_path, "l40s-vfio", vfs=4)
    a = svc.allocate("L40S-2Q", vm="a")
    real_reboot(svc)
    path = tmp_path / "p.toml"
    path.write_text(f'[[gpu]]\naddress = "0000:3d:00.0"\nvf = [{{address = "{a["pci_address"]}", type = "L40S-4Q"}}]\n')
    rc, _, err = run("--sysfs-root", str(svc.host.root), "--state-dir", str(svc.cfg.state_dir),
                     "restore", "--profile", str(path))
    assert rc == 2 and "also a vGPU vgpumgr allocated" in err
    assert read_int(f"{svc.host.pci('0000:3d:00.0')}/sriov_numvfs") == 0
