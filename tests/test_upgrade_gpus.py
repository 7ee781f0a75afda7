"""`upgrade check --kernel --driver` per GPU, from the support matrix (issue 38): a branch that dropped the card, a
kernel the driver is known not to build on, mixed-size mode and MIG-backed vGPU lost; the guests' rule is a seam."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from simhost import run

from vgpumgr.config import Config
from vgpumgr.ops import support_matrix as sm
from vgpumgr.ops.upgrade_check import check
from vgpumgr.sim import profiles


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    def make(profile: str) -> Path:
        root = profiles.create(tmp_path / profile, profile)
        monkeypatch.setenv("VGPUMGR_SYSFS_ROOT", str(root))
        monkeypatch.setenv("VGPUMGR_STATE_DIR", str(tmp_path / f"state-{profile}"))
        monkeypatch.setenv("VGPUMGR_LIBVIRT_URI", "test:///default")
        monkeypatch.setenv("VGPUMGR_HOSTNAME", "h1")
        return root
    return make


def findings(*argv: str) -> tuple[int, list[dict]]:
    rc, out, err = run("upgrade", "check", "--json", *argv)
    assert out, err
    return rc, json.loads(out)["findings"]


def test_the_matrix_answers_yes_no_nvaie_and_unknown_and_names_sources() -> None:
    assert sm.branch_of("550.90.05") == "R550" and sm.branch_of("garbage") is None
    assert sm.support("1b38", "R550").answer == sm.NO  # Pascal P40 left with 17.0
    assert sm.support("1eb8", "R580").answer == sm.YES and sm.support("1eb8", "R595").answer == sm.UNKNOWN
    assert sm.support("20b5", "R570").answer == sm.NVAIE and sm.support("ffff", "R570").family is None
    assert all(row["source"] for key in ("branches", "families", "kernel_breakages") for row in sm.data()[key])
    assert [r["versions"] for r in sm.kernel_breakages("6.14.11-2-pve", "550.90.05")] == [["550.90.05"]]
    assert sm.kernel_breakages("6.8.12", "550.90.05") == []


def test_a_branch_that_drops_the_card_blocks_and_names_the_branches_that_keep_it(env) -> None:  # noqa: ANN001
    env("h100-mig")
    rc, found = findings("--driver", "535.230.02")
    gpu = [f["message"] for f in found if f["area"] == "gpu"]
    assert rc == 0 and any("R535 (vGPU 16.x) does not support" in m and "would offer no vGPU type" in m
                           for m in gpu), found  # no vGPU recorded on it yet: a warning
    assert [f["severity"] for f in found if f["area"] == "gpu"] == ["warn"]


def test_a_kernel_the_driver_does_not_build_on_and_lost_mixed_size_mode_block(env) -> None:  # noqa: ANN001
    env("l40s-vfio")
    assert run("gpu", "mode", "0000:3d:00.0", "--mixed")[0] == 0
    assert run("vm", "create", "web1", "--vgpu", "L40S-2Q")[0] == 0
    rc, out, _ = run("upgrade", "check", "--kernel", "6.14.11", "--driver", "535.230.02")
    assert rc == 10, out
    assert "535.230.02 (R535 (vGPU 16.x)) on kernel 6.14.11: the module does not build" in out
    assert "mixed-size mode exists from R550 (vGPU 17.x) on; R535 (vGPU 16.x) would lose it" in out
    report = json.loads(run("upgrade", "check", "--json", "--driver", "580.159.01")[1])
    assert report["gpus"] == [{"gpu": "0000:3d:00.0", "name": report["gpus"][0]["name"], "device": "26b9",
                               "branch": "R580", "support": "yes", "vgpus": 1}]


def test_mig_backed_vgpus_are_told_of_nvidia_ai_enterprise_and_the_guest_rule_is_asked(env) -> None:  # noqa: ANN001
    root = env("a100-mig")
    assert run("vm", "create", "m1", "--mig", "1g.10gb")[0] == 0  # a MIG-backed vGPU (A100D-1-10C)
    rc, found = findings("--driver", "570.124.03")
    assert any("MIG-backed vGPU(s): from R570 (vGPU 18.x) on MIG GPUs are supported only under NVIDIA AI "
               "Enterprise" in f["message"] for f in found), found
    asked = []

    def guests(vm: str, host_driver: str) -> list[tuple[str, str, str]]:
        asked.append((vm, host_driver))
        return [("block", "guest", f"{vm}: guest driver outside the window of {host_driver}")]

    report = check(Config.resolve(sysfs_root=str(root)), "h1", driver="580.159.01", guests=guests)
    assert asked == [("m1", "580.159.01")] and report.blocked
    assert report.findings[-1].message == "m1: guest driver outside the window of 580.159.01"
