"""`vgpumgr doctor` on the real kernel with QEMU's emulated Intel IOMMU (the SR-IOV boot: q35, intel-iommu,
intel_iommu=on; issue 38): the IOMMU checks pass and list the kernel's real IOMMU groups."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from vgpumgr.cli.main import main

pytestmark = pytest.mark.skipif(os.environ.get("MDEVLAB_IOMMU") != "1", reason="booted without MDEVLAB_IOMMU=1")


def test_the_iommu_passes_and_its_real_groups_are_listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VGPUMGR_SYSFS_ROOT", raising=False)
    monkeypatch.setenv("VGPUMGR_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("VGPUMGR_LIBVIRT_URI", "test:///default")
    out = io.StringIO()
    main(["doctor", "--json"], out=out, err=io.StringIO())
    r = {x["key"]: x for x in json.loads(out.getvalue())["results"] if x["gpu"] is None}
    assert Path("/sys/firmware/acpi/tables/DMAR").exists() and r["iommu.acpi"]["level"] == "PASS"
    groups = sorted((g.name for g in Path("/sys/kernel/iommu_groups").iterdir()
                     if any(":" in d.name for d in (g / "devices").iterdir())), key=int)
    assert groups and r["iommu"]["level"] == "PASS", r["iommu"]
    assert r["iommu"]["message"].startswith(f"{len(groups)} IOMMU group(s) with PCI devices")
    assert ", ".join(groups[:8]) in r["iommu"]["message"]
