"""`vgpumgr restore` on a real kernel: VFs that a driver reload or a reset of sriov_numvfs took away come back
to the count vgpumgr recorded, through the CLI as the boot unit runs it (emulated NVMe PF, --sriov N)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from vgpumgr.cli.main import main

WANTED_VFS = int(os.environ.get("MDEVLAB_SRIOV_VFS") or 0)
PCI_DEVICES = Path("/sys/bus/pci/devices")
NVME_DRIVER = Path("/sys/bus/pci/drivers/nvme")

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(
        os.environ.get("MDEVLAB_GUEST") != "1" or WANTED_VFS < 3,
        reason="runs only in an mdev lab guest booted with --sriov N (N >= 3; scripts/lab-tests)",
    ),
]


def vgpumgr(state: Path, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(["--sysfs-root", "/", "--state-dir", str(state), "--db", f"sqlite:///{state}/vgpumgr.db", *argv],
              out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def virtfns(pf: str) -> list[str]:
    d = PCI_DEVICES / pf
    return sorted(os.path.basename(os.readlink(p)) for p in d.glob("virtfn*"))


def write(path: Path, data: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


def steps(report: str) -> list[tuple[str, str]]:
    return [(st["step"], st["status"]) for g in json.loads(report)["gpus"] for st in g["steps"]]


def test_restore_brings_back_the_recorded_vfs(nvme_pf: str, tmp_path: Path) -> None:
    rc, out, err = vgpumgr(tmp_path, "sriov", "set", nvme_pf, "3")
    assert rc == 0, err
    before = virtfns(nvme_pf)
    assert len(before) == 3

    write(PCI_DEVICES / nvme_pf / "sriov_numvfs", "0")  # what a reboot or a driver reload leaves
    assert virtfns(nvme_pf) == []
    rc, out, err = vgpumgr(tmp_path, "restore", "--dry-run", "--json")
    assert rc == 0 and steps(out) == [("vfs", "planned")], err
    assert virtfns(nvme_pf) == []
    rc, out, err = vgpumgr(tmp_path, "restore", "--json")
    assert rc == 0 and steps(out) == [("vfs", "done")], err
    assert virtfns(nvme_pf) == before
    rc, out, err = vgpumgr(tmp_path, "restore", "--json")
    assert rc == 0 and steps(out) == [("vfs", "ok")], err  # a second run changes nothing

    # reloading the PF's driver: whether the VFs survive is the PF driver's business (the PCI core only
    # warns when a driver leaves SR-IOV enabled); either way restore ends at the recorded count
    write(NVME_DRIVER / "unbind", nvme_pf)
    write(NVME_DRIVER / "bind", nvme_pf)
    survived = virtfns(nvme_pf)
    rc, out, err = vgpumgr(tmp_path, "restore", "--json")
    assert rc == 0 and steps(out) == [("vfs", "ok" if survived else "done")], err
    assert virtfns(nvme_pf) == before
    rc, out, err = vgpumgr(tmp_path, "audit", "--json")
    actions = [e["action"] for e in json.loads(out)]
    assert actions.count("restore.vfs") == (1 if survived else 2) and actions.count("restore") == 3
