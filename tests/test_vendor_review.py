"""Vendor steps that fail part way (CLI on a simulated `all` host): restore holds back the card's VFs and mdevs
after a failed mode step, `vendor prepare` puts the quotas back when the VFs are refused, and a recorded step this
vgpumgr does not know (or cannot read) is an error, never "ok"."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from simhost import run

from vgpumgr.errors import Conflict, KernelError
from vgpumgr.hostfs.root import Host
from vgpumgr.sim import profiles
from vgpumgr.vendors import steps as vendor_steps

ASCEND, MI300X, FLEX = "0000:81:00.0", "0000:89:00.0", "0000:8b:00.0"


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Host:
    root = profiles.create(tmp_path / "host", "all")
    monkeypatch.setenv("VGPUMGR_SYSFS_ROOT", str(root))
    monkeypatch.setenv("VGPUMGR_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VGPUMGR_LIBVIRT_URI", "test:///default")
    monkeypatch.delenv("VGPUMGR_DB", raising=False)
    return Host(root)


def ok(*argv: str) -> str:
    rc, out, err = run(*argv)
    assert rc == 0, (argv, out, err)
    return out


def steps_of(out: str, gpu: str) -> dict[str, str]:
    return {s["step"]: s["status"] for g in json.loads(out)["gpus"] if g["gpu"] == gpu for s in g["steps"]}


def quotas(host: Host) -> list[int]:
    iov = host.pci(FLEX) / "drm/card1/iov"
    return [int((iov / f"vf{n}/gt/lmem_quota").read_text()) >> 20 for n in range(1, 9)]


def test_a_failed_quota_write_holds_the_vfs_back_and_a_second_restore_brings_both(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    ok("vendor", "prepare", FLEX, "--vfs", "8", "--vf-memory", "2000")
    ok("sim", "reboot")
    real_write = vendor_steps.write

    def failing(h: Host, path: Path, data: str, action: str, *a: Any, **kw: Any) -> None:
        if path.name == "lmem_quota":
            raise KernelError(f"{action}: Input/output error")
        real_write(h, path, data, action, *a, **kw)

    monkeypatch.setattr(vendor_steps, "write", failing)
    rc, out, _ = run("restore", "--json")
    assert rc != 0
    steps = steps_of(out, FLEX)
    assert steps["i915-lmem-quota"] == "failed" and steps["vfs"] == "skipped", steps
    [vfs] = [s for g in json.loads(out)["gpus"] for s in g["steps"] if g["gpu"] == FLEX and s["step"] == "vfs"]
    assert "waits for an earlier step: i915-lmem-quota" in vfs["message"]
    # the VFs stayed off, so the driver provisioned no quotas of its own that would refuse the next restore
    assert (host.pci(FLEX) / "sriov_numvfs").read_text() == "0\n" and quotas(host) == [0] * 8
    monkeypatch.setattr(vendor_steps, "write", real_write)
    steps = steps_of(ok("restore", "--json"), FLEX)
    assert steps["i915-lmem-quota"] == "done" and steps["vfs"] == "done", steps
    assert (host.pci(FLEX) / "sriov_numvfs").read_text() == "8\n" and quotas(host) == [2000] * 8


def test_a_failed_vnpu_mode_skips_the_vnpus(host: Host, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ok("vendor", "prepare", ASCEND)
    uuid = json.loads(ok("vm", "create", "v1", "--vgpu", "vnpu-vir02", "--json"))["allocations"][0]["uuid"]
    ok("sim", "reboot")
    broken = tmp_path / "npu-smi"
    broken.write_text("#!/bin/sh\necho 'dcmi error 8' >&2\nexit 1\n")
    os.chmod(broken, 0o755)
    monkeypatch.setenv("VGPUMGR_NPU_SMI", str(broken))
    rc, out, _ = run("restore", "--json")
    assert rc != 0
    got = {s["step"]: s for g in json.loads(out)["gpus"] if g["gpu"] == ASCEND for s in g["steps"]}
    assert got["ascend-vnpu-vm-mode"]["status"] == "failed" and "dcmi error 8" in got["ascend-vnpu-vm-mode"]["message"]
    assert got["mdev"]["status"] == "skipped" and "waits for an earlier step: ascend-vnpu-vm-mode" in \
        got["mdev"]["message"]
    assert not host.mdev(uuid).exists()
    monkeypatch.delenv("VGPUMGR_NPU_SMI")
    steps = steps_of(ok("restore", "--json"), ASCEND)
    assert steps == {"ascend-vnpu-vm-mode": "done", "mdev": "done"}, steps
    assert host.mdev(uuid).exists()


def test_prepare_puts_the_quotas_back_when_the_vfs_are_refused(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    from vgpumgr.backends import sriov

    iov = host.pci(FLEX) / "drm/card1/iov"
    host.write(iov / "vf3/gt/lmem_quota", str(1000 << 20))  # an earlier quota, on a VF the new one leaves out

    def refused(h: Host, pf: str, count: int, **kw: Any) -> list[str]:
        raise KernelError(f"enabling {count} VFs on {pf}: Cannot allocate memory", hint="check `dmesg`")

    monkeypatch.setattr(sriov, "set_numvfs", refused)
    rc, _, err = run("vendor", "prepare", FLEX, "--vfs", "2", "--vf-memory", "2000")
    assert rc == 7 and f"enabling 2 VFs on {FLEX}: Cannot allocate memory" in err, err
    assert quotas(host) == [0, 0, 1000, 0, 0, 0, 0, 0]  # as before: i915 had zeroed VF 3 for the two new ones
    assert (iov / "pf/gt/available/lmem_free").read_text() == f"{15000 << 20}\n"
    assert "vendor.prepare" not in ok("audit")  # nothing recorded


def test_a_quota_rollback_that_fails_too_keeps_the_first_error(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = vendor_steps.write
    failed: list[str] = []

    def flaky(h: Host, path: Path, data: str, action: str, *a: Any, **kw: Any) -> None:
        if "vf2/" in str(path) or failed:  # VF 2's quota is refused, and then every write back too
            failed.append(action)
            raise KernelError(f"{action}: Input/output error")
        real_write(h, path, data, action, *a, **kw)

    monkeypatch.setattr(vendor_steps, "write", flaky)
    rc, _, err = run("vendor", "prepare", FLEX, "--vfs", "2", "--vf-memory", "2000")
    assert rc == 7 and "writing the memory quota of VF 2" in err.splitlines()[0], err
    assert "could not be put back (writing the memory quota of VF 1" in err, err
    assert len(failed) == 2 and (host.pci(FLEX) / "sriov_numvfs").read_text() == "0\n"


def record(pf: str, state: dict[str, Any]) -> None:
    from vgpumgr.config import Config
    from vgpumgr.ops import boot_records

    boot_records.note(Config.resolve(), boot_records.remember_vendor, pf, state)


def test_a_step_a_newer_vgpumgr_recorded_fails_instead_of_passing(host: Host) -> None:
    ok("vendor", "prepare", FLEX, "--vfs", "2", "--vf-memory", "2000")
    record(FLEX, {"i915-lmem-sched": {"quotas": {}, "policy": "strict"}})
    rc, out, _ = run("restore", "--json")
    assert rc != 0
    [step] = [s for g in json.loads(out)["gpus"] if g["gpu"] == FLEX for s in g["steps"]
              if s["step"] == "i915-lmem-sched"]
    assert step["status"] == "failed" and "unknown vendor step 'i915-lmem-sched'" in step["message"], step
    assert "by a newer vgpumgr" in step["message"] and "upgrade vgpumgr" in step["hint"]
    rc, out, _ = run("reconcile", "--json")
    [drift] = json.loads(out)["vendor_drift"]
    assert rc == 10 and drift["step"] == "i915-lmem-sched" and "unknown vendor step" in drift["why"], drift
    with pytest.raises(Conflict, match="unknown vendor step"):
        vendor_steps.apply(host, FLEX, "i915-lmem-sched", {"quotas": {}})


def test_a_gim_record_without_its_vf_num_is_an_error_not_a_crash(host: Host) -> None:
    record(MI300X, {"gim-vf-num": {"vfs": 8}})
    rc, out, err = run("reconcile", "--json")
    assert rc == 10, (out, err)
    [drift] = json.loads(out)["vendor_drift"]
    assert drift["gpu"] == MI300X and "recorded gim-vf-num step of 0000:89:00.0 cannot be read (no 'vf_num')" in \
        drift["why"], drift
    for call in (vendor_steps.read_step, vendor_steps.apply):
        with pytest.raises(Conflict, match="cannot be read"):
            call(host, MI300X, "gim-vf-num", {"vfs": 8})
    with pytest.raises(Conflict, match="cannot be read"):
        vendor_steps.read_step(host, MI300X, "gim-vf-num", {"vf_num": "eight"})
