"""The CLI contract: golden text and JSON for `gpus` and `types`, lifecycle commands, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from simhost import make, run

GOLDEN = Path(__file__).parent / "golden" / "cli"
UPDATE = os.environ.get("VGPUMGR_UPDATE_GOLDEN") == "1"


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"output differs from {path} (VGPUMGR_UPDATE_GOLDEN=1 rewrites it)"


@pytest.mark.parametrize("profile", ["t4", "mixed", "gvtg"])
def test_gpus_and_types_golden(tmp_path: Path, profile: str) -> None:
    root = str(make(tmp_path, profile).root)
    for cmd, extra in (("gpus", []), ("types", [])):
        rc, out, _ = run("--sysfs-root", root, cmd, *extra)
        assert rc == 0
        golden(f"{profile}-{cmd}.txt", out)
        rc, out, _ = run("--sysfs-root", root, cmd, "--json", *extra)
        assert rc == 0
        golden(f"{profile}-{cmd}.json", out)


def test_json_contract_fields(tmp_path: Path) -> None:
    root = str(make(tmp_path, "mixed").root)
    gpus = json.loads(run("--sysfs-root", root, "gpus", "--json")[1])
    for g in gpus:
        assert {"address", "vendor_id", "device_id", "name", "driver", "numa_node", "iommu_group", "physfn", "sriov",
                "backends"} <= set(g)
    vf = next(g for g in gpus if g["address"] == "0000:3d:00.4")
    assert vf["physfn"] == "0000:3d:00.0"
    types = json.loads(run("--sysfs-root", root, "types", "--json")[1])
    for t in types:
        assert {"parent", "type", "name", "description", "device_api", "available_instances", "backend"} <= set(t)
        assert t["backend"] in ("mdev", "nvidia-vf")


def test_type_named_by_id_short_or_full_name(tmp_path: Path) -> None:
    root = str(make(tmp_path, "t4").root)
    for name in ("nvidia-232", "T4-4Q", "GRID T4-4Q"):
        rc, out, err = run("--sysfs-root", root, "mdev", "create", "--parent", "0000:3b:00.0", "--type", name, "--json")
        assert rc == 0, err
        assert json.loads(out)["type"] == "nvidia-232"
    listed = json.loads(run("--sysfs-root", root, "mdev", "list", "--json")[1])
    assert len(listed) == 3
    for m in listed:
        assert run("--sysfs-root", root, "mdev", "remove", m["uuid"])[0] == 0
    assert json.loads(run("--sysfs-root", root, "mdev", "list", "--json")[1]) == []


@pytest.mark.parametrize("argv, code, message", [
    (["mdev", "create", "--parent", "../../etc", "--type", "x"], 2, "is not an mdev parent"),
    (["mdev", "create", "--parent", "0000:3b:00.0", "--type", "T4-4Q", "--uuid", "nope"], 2, "is not a UUID"),
    (["mdev", "create", "--parent", "0000:3b:00.0", "--type", "T4-99Q"], 3, "no vGPU type 'T4-99Q'"),
    (["mdev", "remove", "c0ffee00-0000-4000-8000-000000000009"], 3, "no mdev"),
    (["types", "--parent", "0000:aa:00.0"], 3, "no mdev parent or vGPU VF"),
    (["vf", "set", "0000:3b:00.0", "nvidia-1"], 2, "no NVIDIA vendor-specific"),
    (["sriov", "set", "0000:3b:00.0", "2"], 2, "not SR-IOV capable"),
])
def test_bad_input_exits_non_zero_with_a_clear_message(tmp_path: Path, argv: list[str], code: int, message: str
                                                       ) -> None:
    root = str(make(tmp_path, "t4").root)
    rc, out, err = run("--sysfs-root", root, *argv)
    assert rc == code
    assert message in err and "hint:" in err


def test_no_capacity_and_busy_exit_codes(tmp_path: Path) -> None:
    root = str(make(tmp_path, "t4").root)
    u = "c0ffee00-0000-4000-8000-00000000000a"
    rc, _, _ = run("--sysfs-root", root, "mdev", "create", "--parent", "0000:3b:00.0", "--type", "T4-16Q", "--uuid", u)
    assert rc == 0
    rc, _, err = run("--sysfs-root", root, "mdev", "create", "--parent", "0000:3b:00.0", "--type", "T4-1Q")
    assert rc == 4 and "no nvidia-230 instances left" in err
    assert run("--sysfs-root", root, "sim", "hold", u)[0] == 0
    rc, _, err = run("--sysfs-root", root, "mdev", "remove", u)
    assert rc == 4 and "qemu-system-x86[" in err


def test_vf_commands(tmp_path: Path) -> None:
    root = str(make(tmp_path, "l40s-vfio", vfs=2).root)
    rc, out, err = run("--sysfs-root", root, "vf", "set", "0000:3d:00.4", "L40S-4Q")
    assert rc == 0, err
    assert "nvidia-1150" in out
    rows = json.loads(run("--sysfs-root", root, "vf", "list", "--json")[1])
    assert rows[0] == {"address": "0000:3d:00.4", "physfn": "0000:3d:00.0", "current_vgpu_type": "nvidia-1150",
                       "creatable": 0}
    assert run("--sysfs-root", root, "vf", "clear", "0000:3d:00.4")[0] == 0


def test_sysfs_root_from_environment_and_missing_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(make(tmp_path, "t4").root)
    monkeypatch.setenv("VGPUMGR_SYSFS_ROOT", root)
    assert json.loads(run("gpus", "--json")[1])[0]["address"] == "0000:3b:00.0"
    rc, _, err = run("--sysfs-root", str(tmp_path / "missing"), "gpus")
    assert rc == 2 and "is not a directory" in err


def test_console_script_runs_and_help_is_fast_to_import(tmp_path: Path) -> None:
    root = str(make(tmp_path, "t4").root)
    exe = Path(sys.executable).with_name("vgpumgr")
    p = subprocess.run([str(exe), "--sysfs-root", root, "types", "--json"], capture_output=True, text=True, check=True)
    assert len(json.loads(p.stdout)) == 17
    code = "import sys, vgpumgr.cli.main as m; m.build_parser(); print(sorted(k for k in sys.modules if k in " \
           "('lxml', 'libvirt', 'sqlalchemy', 'fastapi', 'pyudev', 'pynvml')))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert p.stdout.strip() == "[]"  # no heavy import on the CLI start path


def test_token_commands(tmp_path: Path) -> None:
    root = str(make(tmp_path, "t4").root)
    rc, secret, err = run("--sysfs-root", root, "token", "create", "--name", "pve", "--role", "hook")
    assert rc == 0, err
    assert secret.startswith("vgm_")
    rows = json.loads(run("--sysfs-root", root, "token", "list", "--json")[1])
    assert [(r["name"], r["role"]) for r in rows] == [("pve", "hook")]
    assert secret.strip() not in json.dumps(rows)  # never printed again
    assert run("--sysfs-root", root, "token", "revoke", "pve")[0] == 0
    assert json.loads(run("--sysfs-root", root, "token", "list", "--json")[1]) == []
    with pytest.raises(SystemExit) as e:  # argparse refuses an unknown role with exit code 2
        run("--sysfs-root", root, "token", "create", "--name", "x", "--role", "root")
    assert e.value.code == 2


def demo_text(out: str, demo_dir: str) -> str:
    """The demo's output with what differs from run to run replaced: its folder, UUIDs, hashes and key ids,
    times and durations."""
    import re

    out = out.replace(demo_dir, "DIR")
    out = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "UUID", out)
    out = re.sub(r"[0-9a-f]{16,64}", "HEX", out)
    out = re.sub(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}[T ][0-9:.+Z-]*", "TIME", out)
    return re.sub(r"in [0-9.]+ s", "in N s", out)


def test_demo_runs_the_main_job(tmp_path: Path) -> None:
    rc, out, err = run("demo", "--dir", str(tmp_path / "demo"))
    assert rc == 0, err + out
    for marker in ("$ vgpumgr vm create web1 --vgpu T4-4Q", "VM ml1 defined", "no free vWS licence seat",
                   "restore: ", "recorded vGPUs missing on the host: 0", "audit chain intact", "demo finished"):
        assert marker in out
    golden("demo.txt", demo_text(out, str(tmp_path / "demo")))  # the same steps and output, whatever its speed


def test_print_xml_is_a_dry_run_without_database_or_libvirt(tmp_path: Path) -> None:
    host = make(tmp_path, "mixed")
    root = str(host.root)
    rc, out, err = run("--sysfs-root", root, "vm", "create", "dry", "--vgpu", "T4-4Q", "--mig", "3g.40gb",
                       "--passthrough", "0000:00:02.0", "--display", "--print-xml")
    assert rc == 0, err
    assert out.count("<hostdev") == 3 and "display=\"on\"" in out and "managed=\"yes\"" in out
    assert not (host.root / ".vgpumgr-state" / "vgpumgr.db").exists()  # no database was even opened
    assert json.loads(run("--sysfs-root", root, "mdev", "list", "--json")[1]) == []
    rc, _, err = run("--sysfs-root", root, "vm", "create", "dry", "--vgpu", "T4-99Q", "--print-xml")
    assert rc == 3 and "T4-99Q" in err


@pytest.mark.parametrize("profile", ["mixed", "a40-sriov", "samples"])
def test_types_json_fast_path_matches_the_discovered_objects(tmp_path: Path, profile: str) -> None:
    from vgpumgr.discovery.inventory import discover_types

    host = make(tmp_path, profile)
    for attempt in range(2):  # the first run fills the type cache, the second reads it
        fast = json.loads(run("--sysfs-root", str(host.root), "types", "--json")[1])
        slow = [t.to_json() for t in discover_types(host)]
        key = lambda d: (d["parent"], d["type"])  # noqa: E731
        assert sorted(fast, key=key) == sorted(slow, key=key), attempt
    assert (host.root / ".vgpumgr-state" / "cache" / "mdev-types.json").exists()


def test_manual_changes_are_audited_and_an_unwritable_log_only_warns(tmp_path: Path) -> None:
    root = str(make(tmp_path, "t4").root)
    rc, out, _ = run("--sysfs-root", root, "mdev", "create", "--parent", "0000:3b:00.0", "--type", "T4-4Q", "--json")
    assert rc == 0
    uuid = json.loads(out)["uuid"]
    events = json.loads(run("--sysfs-root", root, "audit", "--json")[1])
    assert [(e["action"], e["vgpu"]) for e in events] == [("mdev.create", uuid)]
    rc, _, _ = run("--sysfs-root", root, "--db", "sqlite:////proc/no/such/dir.db", "mdev", "remove", uuid)
    assert rc == 0  # the device is gone; the warning went to stderr
    assert json.loads(run("--sysfs-root", root, "mdev", "list", "--json")[1]) == []


def test_mig_and_scheduler_commands(tmp_path: Path) -> None:
    root = str(make(tmp_path, "h100-mig", vfs=4).root)
    rc, out, err = run("--sysfs-root", root, "mig", "plan", "0000:19:00.0", "3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")
    assert rc == 0, err
    assert out.splitlines() == ["3g.40gb: start 4 size 4", "2g.20gb: start 0 size 2",  # a full layout, packed
                                "1g.10gb: start 2 size 1", "1g.10gb: start 3 size 1"]
    rc, out, err = run("--sysfs-root", root, "mig", "create", "0000:19:00.0", "3g.40gb", "--start", "4")
    assert rc == 0, err
    gi = json.loads(out)
    assert (gi["profile"], gi["start"]) == ("3g.40gb", 4)
    rc, _, err = run("--sysfs-root", root, "mig", "create", "0000:19:00.0", "7g.80gb")
    assert rc == 4 and "no room for a 7g.80gb instance (slices 4-7 taken by 3g.40gb (GI " in err
    assert json.loads(run("--sysfs-root", root, "types", "--parent", "0000:19:00.4", "--json")[1])[0]["name"] \
        == "NVIDIA H100XM-3-40C"  # the driver now offers the matching MIG-backed type
    rc, _, err = run("--sysfs-root", root, "mig", "mode", "0000:19:00.0", "off")
    assert rc == 4 and "in use" in err  # a GPU instance exists
    assert run("--sysfs-root", root, "mig", "destroy", "0000:19:00.0", str(gi["id"]))[0] == 0
    assert json.loads(run("--sysfs-root", root, "types", "--parent", "0000:19:00.4", "--json")[1]) == []
    rc, out, err = run("--sysfs-root", root, "scheduler", "set", "0000:19:00.0", "equal-share")
    assert rc == 4 and "MIG mode is on" in err  # NVML refuses a scheduler change while MIG is on
    assert run("--sysfs-root", root, "mig", "mode", "0000:19:00.0", "off")[0] == 0
    rc, out, err = run("--sysfs-root", root, "scheduler", "set", "0000:19:00.0", "equal-share")
    assert rc == 0, err
    assert json.loads(run("--sysfs-root", root, "scheduler", "show", "0000:19:00.0")[1])["policy"] == "equal-share"
    actions = [e["action"] for e in json.loads(run("--sysfs-root", root, "audit", "--json")[1])]
    assert actions == ["mig.gi.create", "mig.gi.destroy", "mig.mode", "vgpu.scheduler"]


def test_nvml_commands_need_nvml(tmp_path: Path) -> None:
    root = str(make(tmp_path, "t4").root)  # no simulated NVML on this profile
    rc, _, err = run("--sysfs-root", root, "mig", "list")
    assert rc == 8 and "NVML" in err


def test_mdev_remove_refuses_while_a_running_libvirt_domain_uses_it(tmp_path: Path) -> None:
    from vgpumgr.config import Config
    from vgpumgr.service import Service

    host = make(tmp_path, "t4")
    svc = Service(Config.resolve(sysfs_root=str(host.root)), licence_mode="off")  # the CLI's own defaults
    uuid = svc.create_vm("web1", vgpus=["T4-4Q"], start=True)["allocations"][0]["uuid"]
    rc, _, err = run("--sysfs-root", str(host.root), "mdev", "remove", uuid)
    assert rc == 4 and "running libvirt domain web1" in err
    svc.stop_vm("web1")  # a stopped domain holds nothing in the kernel
    rc, _, err = run("--sysfs-root", str(host.root), "mdev", "remove", uuid)
    assert rc == 0, err


def test_the_demo_builds_its_host_in_ram_unless_told_otherwise(tmp_path: Path, monkeypatch) -> None:
    import tempfile

    from vgpumgr.sim import demo

    ram, elsewhere = tmp_path / "shm", tmp_path / "tmp"
    ram.mkdir()
    elsewhere.mkdir()
    monkeypatch.setattr(demo, "RAM_DIR", str(ram))
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))  # tempfile's default folder
    monkeypatch.delenv("TMPDIR", raising=False)
    assert demo.scratch_dir().parent == ram
    monkeypatch.setattr(demo, "RAM_DIR_MIN_FREE", 1 << 62)  # no room there: the ordinary temporary folder
    assert demo.scratch_dir().parent == elsewhere
    monkeypatch.undo()
    monkeypatch.setattr(demo, "RAM_DIR", str(ram))
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))
    monkeypatch.setenv("TMPDIR", str(elsewhere))  # the user's choice wins
    assert demo.scratch_dir().parent == elsewhere
    monkeypatch.setattr(demo, "RAM_DIR", str(tmp_path / "missing"))
    monkeypatch.delenv("TMPDIR")
    assert demo.scratch_dir().parent == elsewhere
