"""`vgpumgr doctor` on the real kernel (issue 38), boot 1 (no IOMMU): the IOMMU check FAILs with its hint, and the
VFIO and mdev modules and the sample mdev parents are reported as the kernel has them."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from vgpumgr.cli.main import main


def doctor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, dict[str, dict]]:
    monkeypatch.delenv("VGPUMGR_SYSFS_ROOT", raising=False)  # the real root, "/"
    monkeypatch.setenv("VGPUMGR_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("VGPUMGR_LIBVIRT_URI", "test:///default")
    out = io.StringIO()
    rc = main(["doctor", "--json"], out=out, err=io.StringIO())
    report = json.loads(out.getvalue())
    return rc, {r["key"]: r for r in report["results"] if r["gpu"] is None}


def loaded(name: str) -> bool:
    return any(line.split()[0] == name for line in Path("/proc/modules").read_text().splitlines()) or \
        Path(f"/sys/module/{name}").is_dir()


def test_doctor_on_a_kernel_without_an_iommu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             make_mdev: object) -> None:
    """One doctor run (about a minute under TCG): the IOMMU check FAILs with its hint, modules and the sample
    mdev parents as the kernel has them."""
    make_mdev("mtty", "mtty-1")  # type: ignore[operator]  # an mdev's own IOMMU group is no IOMMU
    rc, r = doctor(tmp_path, monkeypatch)
    assert rc == 12
    assert r["iommu"]["level"] == "FAIL", r["iommu"]
    assert "iommu=pt" in r["iommu"]["hint"] and "GRUB_CMDLINE_LINUX_DEFAULT" in r["iommu"]["hint"]
    assert r["iommu.acpi"]["level"] == "WARN" and not any(
        Path(f"/sys/firmware/acpi/tables/{t}").exists() for t in ("DMAR", "IVRS"))
    for name in ("vfio", "vfio_iommu_type1", "vfio_pci"):
        assert (r[f"module.{name}"]["level"] == "PASS") == loaded(name), (name, r[f"module.{name}"])
    parents = sorted(os.listdir("/sys/class/mdev_bus"))
    assert {"mtty", "mdpy", "mbochs"} <= set(parents)
    mdev = r["module.mdev"]
    assert loaded("mdev") and mdev["level"] == "PASS"
    assert f"{len(parents)} parent(s): {', '.join(parents[:3])}" in mdev["message"], mdev
    flags = Path("/proc/cpuinfo").read_text()
    assert (r["cpu"]["level"] == "PASS") == (" vmx" in flags or " svm" in flags)
    assert (r["kvm"]["level"] == "PASS") == Path("/dev/kvm").exists()
