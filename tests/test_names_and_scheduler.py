"""GPU model names (NVML first, then udev's hwdb, then pci.ids) and `scheduler show` over every GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from simhost import make, run
from test_nvml import REAL, ReplayNvml

from vgpumgr.discovery import pci
from vgpumgr.discovery.pci import PciNames, discover_gpus
from vgpumgr.hostfs.root import Host
from vgpumgr.nvidia.facts import merge_facts
from vgpumgr.nvidia.nvml import NvmlLayer

H100_PF = "0000:19:00.0"  # the h100-mig profile's PF
REAL_H100 = "0000:00:06.0"  # the address in the real capture


def _without_pci_ids(host: Host) -> Host:
    for rel in PciNames.PCI_IDS:
        (host.root / rel).unlink(missing_ok=True)
    return host


def _gpus(root: Path, *extra: str) -> dict[str, dict]:
    rc, out, err = run("--sysfs-root", str(root), "gpus", "--json", *extra)
    assert rc == 0, err
    return {g["address"]: g for g in json.loads(out)}


def test_nvml_names_a_gpu_that_pci_ids_does_not_know(tmp_path: Path) -> None:
    host = _without_pci_ids(make(tmp_path, "h100-mig", vfs=2))
    bare = _gpus(host.root, "--no-nvml")
    assert bare[H100_PF]["name"] == "PCI device 10de:2330"  # what the real host showed before
    named = _gpus(host.root)
    assert named[H100_PF]["name"] == REAL["gpu_name"] == "NVIDIA H100 80GB HBM3"
    vfs = [a for a, g in named.items() if g["physfn"] == H100_PF]
    assert vfs and all(named[v]["name"] == REAL["gpu_name"] for v in vfs)  # VFs take the PF's NVML name
    rc, out, _ = run("--sysfs-root", str(host.root), "gpus")
    assert rc == 0 and "NVIDIA H100 80GB HBM3" in out and "PCI device" not in out


def test_the_real_h100_capture_names_the_gpu(tmp_path: Path) -> None:
    host = _without_pci_ids(make(tmp_path, "h100-mig"))
    facts = NvmlLayer(ReplayNvml(REAL)).gpus()
    assert set(facts) == {REAL_H100}
    gpus = discover_gpus(host)
    merge_facts(gpus, {H100_PF: facts[REAL_H100]})
    pf = next(g for g in gpus if g.address == H100_PF)
    assert pf.name == "NVIDIA H100 80GB HBM3"
    assert pf.nvml is facts[REAL_H100]


def test_nvml_then_hwdb_then_pci_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = make(tmp_path, "h100-mig")
    from_ids = PciNames(host).lookup("10de", "2330", H100_PF)
    assert from_ids == "NVIDIA GH100 [H100 SXM5 80GB]"  # the simulated root's pci.ids
    hwdb = "NVIDIA GH100 [H100 SXM5 80GB] (hwdb)"
    monkeypatch.setattr(pci.PciNames, "from_udev", lambda self, address: hwdb)
    gpus = discover_gpus(host)
    pf = next(g for g in gpus if g.address == H100_PF)
    assert pf.name == hwdb  # hwdb before pci.ids
    merge_facts(gpus, {H100_PF: {"name": None, "mig": {}}})
    assert pf.name == hwdb  # NVML without a name leaves it
    merge_facts(gpus, {H100_PF: {"name": "NVIDIA H100 80GB HBM3", "mig": {}}})
    assert pf.name == "NVIDIA H100 80GB HBM3"  # NVML before both


def test_scheduler_show_lists_every_gpu(tmp_path: Path) -> None:
    root = str(make(tmp_path, "mixed").root)
    nvml_gpus = set(json.loads(run("--sysfs-root", root, "mig", "list", "--json")[1]))
    assert len(nvml_gpus) >= 2
    rc, out, err = run("--sysfs-root", root, "scheduler", "show", "--json")
    assert rc == 0, err
    every = json.loads(out)
    assert set(every) == nvml_gpus
    assert len(nvml_gpus) == 3  # the T4 has a simulated NVML too
    t4, first, second = sorted(nvml_gpus)  # T4, L40S (MIG-less), A100 (MIG on: NVML refuses a scheduler change)
    first, second = second, first
    assert run("--sysfs-root", root, "scheduler", "set", second, "equal-share")[0] == 0
    rc, out, err = run("--sysfs-root", root, "scheduler", "show")
    assert rc == 0, err
    lines = out.split("\n\n")[0].splitlines()  # then the GPUs with MIG on, per GPU instance (test_scheduler.py)
    assert lines[0].split()[:3] == ["GPU", "NAME", "POLICY"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == nvml_gpus
    assert " equal-share " in rows[second] and " best-effort " in rows[t4]
    assert rows[first].split()[5] == "-"  # MIG on: NVML answers NotSupported for the GPU's own scheduler ...
    assert f"{first}: MIG-backed vGPUs get fixed share" in out  # ... and says why (before GB20x)
    one = json.loads(run("--sysfs-root", root, "scheduler", "show", second)[1])
    assert one == json.loads(run("--sysfs-root", root, "scheduler", "show", "--json")[1])[second]
    rc, _, err = run("--sysfs-root", root, "scheduler", "show", "not-a-bdf")
    assert rc == 2 and "not-a-bdf" in err
