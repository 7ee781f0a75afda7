"""`vgpumgr doctor` (issue 38): each failing state the simulator can make is named with its fix; the text is
golden; only a FAIL fails the run (exit 12); `--for TYPE` explains end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from simhost import run
from test_cli import golden

from vgpumgr.sim import profiles


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = profiles.create(tmp_path / "host", "mixed")
    monkeypatch.setenv("VGPUMGR_SYSFS_ROOT", str(root))
    monkeypatch.setenv("VGPUMGR_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VGPUMGR_LIBVIRT_URI", "test:///default")
    monkeypatch.setenv("VGPUMGR_HOSTNAME", "h1")
    monkeypatch.delenv("VGPUMGR_LICENCE_MODE", raising=False)
    return root


def doctor(*argv: str) -> tuple[int, dict]:
    rc, out, err = run("doctor", "--json", *argv)
    assert out, err
    return rc, json.loads(out)


def results(report: dict, level: str) -> dict[tuple[str, str | None], dict]:
    return {(r["key"], r["gpu"]): r for r in report["results"] if r["level"] == level}


def test_a_healthy_simulated_host_passes_and_its_text_is_golden(host: Path) -> None:
    rc, out, _ = run("doctor")
    assert rc == 0, out
    golden("doctor-mixed.txt", re.sub(r"libvirt \d+\.\d+\.\d+", "libvirt X.Y.Z", out))
    rc, report = doctor()
    assert rc == 0 and report["ok"] and report["summary"]["fail"] == 0
    assert report["summary"]["total"] == len(report["results"]) == sum(
        report["summary"][k] for k in ("pass", "note", "warn", "fail"))
    assert all(r["hint"] for r in report["results"] if r["level"] != "PASS")


# (state, sim break options, the FAIL's key and GPU, words its hint must name)
BROKEN = [
    ("no-virt", [], "cpu", None, "VT-x / AMD-V"),
    ("no-kvm", [], "kvm", None, "modprobe kvm_intel"),
    ("iommu-off", [], "iommu", None, "intel_iommu=on iommu=pt to GRUB_CMDLINE_LINUX_DEFAULT"),
    ("module-missing", [], "module.vfio_pci", None, "modprobe vfio_pci"),
    ("module-missing", ["--module", "mdev"], "module.mdev", None, "modprobe mdev"),
    ("unit-failed", [], "unit.vgpu_mgr", None, "journalctl -u nvidia-vgpu-mgr"),
    ("unit-failed", ["--unit", "nvidia-vgpud.service"], "unit.vgpud", None, "journalctl -u nvidia-vgpud"),
    ("no-vgpu-driver", [], "nvidia.vgpu", None, "-vgpu-kvm.run"),
    ("secure-boot", [], "nvidia.module", None, "mokutil --import"),
    ("nouveau", [], "gpu.driver", "0000:3b:00.0", "blacklist nouveau"),
    ("unbound", ["--gpu", "0000:3d:00.0"], "gpu.driver", "0000:3d:00.0", "modprobe nvidia"),
    ("vfs-off", ["--gpu", "0000:3d:00.0"], "gpu.vfs", "0000:3d:00.0", "sriov-manage -e 0000:3d:00.0"),
    ("mig-pending", ["--gpu", "0000:65:00.0"], "gpu.mig", "0000:65:00.0", "nvidia-smi --gpu-reset -i"),
]


@pytest.mark.parametrize("state, opts, key, gpu, hint", BROKEN, ids=[f"{b[0]}-{b[2]}" for b in BROKEN])
def test_each_failing_state_is_named_with_its_fix(host: Path, state: str, opts: list[str], key: str,
                                                  gpu: str | None, hint: str) -> None:
    assert run("sim", "break", state, *opts)[0] == 0
    rc, report = doctor()
    assert rc == 12 and not report["ok"]
    fails = results(report, "FAIL")
    assert (key, gpu) in fails, sorted(fails)
    assert hint in fails[(key, gpu)]["hint"]
    rc, out, _ = run("doctor")
    assert rc == 12 and hint in out and "FAIL:" in out


def test_a_branch_that_dropped_the_card_fails_with_the_branches_that_have_it(host: Path, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    rc, _, err = run("sim", "break", "branch", "--gpu", "0000:3b:00.0")
    assert rc == 2 and "no branch in the support matrix refuses 0000:3b:00.0" in err  # T4: every branch or unknown
    assert run("sim", "break", "branch", "--driver", "535.230.02")[0] == 0
    assert results(doctor()[1], "PASS")[("gpu.branch", "0000:3b:00.0")]["message"].startswith("R535 (vGPU 16.x)")
    # an H100 SXM5 is absent from R535's catalog: a host with it and a 16.x driver offers it nothing
    root = profiles.create(tmp_path / "h100", "h100-mig")  # the h100 profile's GPU: 0000:19:00.0
    monkeypatch.setenv("VGPUMGR_SYSFS_ROOT", str(root))
    assert run("sim", "break", "branch")[0] == 0
    rc, report = doctor()
    fail = results(report, "FAIL")[("gpu.branch", "0000:19:00.0")]
    assert rc == 12 and "R535 (vGPU 16.x) does not support" in fail["message"]
    assert "install a vGPU host driver of a branch that supports it" in fail["hint"]


def test_gpu_limits_the_per_gpu_checks_and_a_bad_address_is_refused(host: Path) -> None:
    rc, report = doctor("--gpu", "0000:3d:00.0")
    assert rc == 0 and {r["gpu"] for r in report["results"]} == {None, "0000:3d:00.0"}
    assert run("doctor", "--gpu", "0000:aa:00.0")[0] == 3
    assert run("doctor", "--gpu", "../x")[0] == 2


def test_for_a_type_names_the_vfs_and_the_placement_words(host: Path) -> None:
    assert run("sim", "break", "vfs-off", "--gpu", "0000:3d:00.0")[0] == 0
    rc, out, _ = run("doctor", "--for", "L40S-4Q")
    assert rc == 12, out
    assert "it cannot be made on this host now" in out and "cards that offer L40S-4Q: 0000:3d:00.0" in out
    assert "sriov-manage -e 0000:3d:00.0" in out and "place --type L40S-4Q --explain" in out
    rc, out, _ = run("doctor", "--for", "T4-4Q", "--json")
    answer = json.loads(out)
    assert rc == 0 and answer["can_make"] and answer["placement"]["choice"]["gpu"] == "0000:3b:00.0"


def test_a_failed_vgpud_is_told_from_a_healthy_one_that_exited(host: Path) -> None:
    report = doctor()[1]
    assert "inactive with exit status 0" in results(report, "PASS")[("unit.vgpud", None)]["message"]


def test_sim_break_refuses_an_unknown_state(host: Path) -> None:
    rc, _, err = run("sim", "break", "everything")
    assert rc == 2 and "unknown state 'everything'" in err and "iommu-off" in err
