"""Each vendor path as a user runs it (CLI on a simulated `all` host, libvirt's test driver, SQLite): listings with
sizes, the mode steps, placement, `vm create` with the XML validated against libvirt's schema, passthrough-only
cards, restore after `sim reboot`, the libvirt hook's prepare, and `demo --profile all`."""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from lxml import etree
from simhost import run

from vgpumgr.discovery.inventory import scan
from vgpumgr.hostfs.root import Host
from vgpumgr.sim import profiles
from vgpumgr.sim.vendor_gpus import NPU_SMI

ASCEND, ASCEND_910B, MTT, MLU, MI300X, FLEX, BMG = ("0000:81:00.0", "0000:83:00.0", "0000:85:00.0", "0000:87:00.0",
                                                    "0000:89:00.0", "0000:8b:00.0", "0000:8d:00.0")
_names = itertools.count()


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Host:
    root = profiles.create(tmp_path / "host", "all")
    monkeypatch.setenv("VGPUMGR_SYSFS_ROOT", str(root))
    monkeypatch.setenv("VGPUMGR_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VGPUMGR_LIBVIRT_URI", "test:///default")
    monkeypatch.setenv("VGPUMGR_LICENCE_MODE", "enforce")
    monkeypatch.delenv("VGPUMGR_DB", raising=False)
    return Host(root)


def ok(*argv: str) -> str:
    rc, out, err = run(*argv)
    assert rc == 0, (argv, out, err)
    return out


def vm(prefix: str) -> str:
    return f"{prefix}{os.getpid()}x{next(_names)}"


def prepare_all() -> None:
    ok("vendor", "prepare", ASCEND)
    ok("vendor", "prepare", FLEX, "--vfs", "8", "--vf-memory", "2000")
    ok("vendor", "prepare", BMG, "--vfs", "4")
    ok("vendor", "prepare", MLU, "--vfs", "4")


def test_listings_with_sizes(host: Host) -> None:
    prepare_all()
    gpus = {g["address"]: g for g in json.loads(ok("gpus", "--json", "--no-nvml"))}
    assert gpus[ASCEND]["name"] == "Huawei Ascend 310P" and gpus[MI300X]["backends"] == ["vf", "passthrough"]
    types = json.loads(ok("types", "--json"))
    by = {(t["parent"], t["type"]): t for t in types}
    assert by[(ASCEND, "vnpu-vir04")]["framebuffer_mb"] == 12288
    assert by[(ASCEND, "vnpu-vir04")]["available_instances"] == 1
    assert by[(MTT, "mtgpu-1108")]["framebuffer_mb"] == 8192
    mi = by[("0000:89:00.4", "vf-mi300x_cpx")]
    assert (mi["name"], mi["backend"], mi["framebuffer_mb"], mi["max_instance"]) == ("AMD MI300X-CPX", "vf", 24576, 8)
    flex = by[("0000:8b:00.4", "vf-flex170_1of8")]
    assert flex["framebuffer_mb"] == 2000 and "driver quota" in flex["description"]  # read from lmem_quota
    assert by[("0000:8d:00.5", "vf-arcprob60_1of4")]["framebuffer_mb"] == 6144  # xe's fair provisioning
    listed = ok("vendor", "list")
    assert "vnpu-mode 1 (VM)" in listed and "8 VF quota(s) 2000 MiB" in listed and "GIM VFs 8" in listed


def test_a_vm_on_a_slice_of_each_vendor(host: Host) -> None:
    prepare_all()
    wanted = {"vnpu-vir02": ("mdev", ASCEND), "mtgpu-1104": ("mdev", MTT), "MLU370-S4-1of4": ("vf", "0000:87:00.4"),
              "MI300X-CPX": ("vf", "0000:89:00.4"), "Flex170-1of8": ("vf", "0000:8b:00.4"),
              "ArcProB60-1of4": ("vf", "0000:8d:00.4")}
    for slice_, (backend, parent) in wanted.items():
        name = vm("s")
        out = json.loads(ok("vm", "create", name, "--vgpu", slice_, "--json"))  # the XML is validated on create
        [a] = out["allocations"]
        assert (a["backend"], a["parent"], a["licence"]) == (backend, parent, None)
        xml = etree.fromstring(ok("vm", "xml", name).encode())
        [hd] = xml.findall("devices/hostdev")
        if backend == "mdev":
            assert hd.get("type") == "mdev" and hd.find("source/address").get("uuid") == a["uuid"]
        else:  # libvirt moves the whole VF to vfio-pci at start
            assert (hd.get("type"), hd.get("managed")) == ("pci", "yes")
            addr = hd.find("source/address")
            assert f"{addr.get('bus')[2:]}:{addr.get('slot')[2:]}.{addr.get('function')[2:]}" == parent[5:]
    # the next Flex slice goes to the next free VF; every VF taken -> refused with the reason
    assert json.loads(ok("place", "--type", "Flex170-1of8", "--json"))["choice"]["parent"] == "0000:8b:00.5"
    for _ in range(7):
        ok("vm", "create", vm("f"), "--vgpu", "Flex170-1of8")
    rc, out, err = run("vm", "create", vm("f"), "--vgpu", "Flex170-1of8")
    assert rc == 4 and "no free VF (8 of 8 VFs hold a vGPU)" in err


def test_release_gives_the_vf_back(host: Host) -> None:
    name = vm("r")
    ok("vm", "create", name, "--vgpu", "MI300X-CPX")
    assert "7 of 8 VFs free" in ok("place", "--type", "MI300X-CPX", "--explain")
    ok("vm", "delete", name)
    assert "8 of 8 VFs free" in ok("place", "--type", "MI300X-CPX", "--explain")


def test_a_held_vf_is_neither_placed_nor_released(host: Host) -> None:
    ok("sim", "hold", "0000:89:00.4")  # a process (a VM nobody recorded) holds the VF's VFIO group
    types = {t["parent"]: t for t in json.loads(ok("types", "--json", "--parent", MI300X))}
    assert types["0000:89:00.4"]["available_instances"] == 0 and types["0000:89:00.5"]["available_instances"] == 1
    name = vm("h")
    a = json.loads(ok("vm", "create", name, "--vgpu", "MI300X-CPX", "--json"))["allocations"][0]
    assert a["pci_address"] == "0000:89:00.5"
    ok("sim", "hold", "0000:89:00.5")
    rc, _, err = run("release", "0000:89:00.5")
    assert rc == 4 and "in use by" in err
    assert "0000:89:00.5" in ok("placements")


def test_print_xml_of_a_vendor_vf_validates(host: Host) -> None:
    xml = ok("vm", "create", vm("p"), "--vgpu", "MI300X-CPX", "--print-xml", "--validate")
    assert "managed=\"yes\"" in xml and 'bus="0x89"' in xml
    xml = ok("vm", "create", vm("p"), "--passthrough", "Enflame S60", "--print-xml", "--validate")
    assert 'bus="0x93"' in xml


def test_passthrough_only_cards(host: Host) -> None:
    for asked in ("910B", "vnpu-vir05_1c_16g", "Ascend 910B"):
        rc, _, err = run("vm", "create", vm("x"), "--vgpu", asked)
        assert rc == 2 and "gives VMs whole devices only" in err and f"--passthrough {ASCEND_910B}" in err
    rc, _, err = run("vendor", "prepare", "0000:8f:00.0")
    assert rc == 2 and "Hygon DCU K100_AI" in err and "whole devices only" in err
    name = vm("w")
    a = json.loads(ok("vm", "create", name, "--passthrough", ASCEND_910B, "--json"))["allocations"][0]
    assert (a["backend"], a["type_name"], a["licence"], a["series"]) == ("passthrough", "Huawei Ascend 910B", None,
                                                                         None)
    # by model: the lowest free card of it; none left -> refused with each one's reason
    rc, _, err = run("vm", "create", vm("w"), "--passthrough", "Ascend 910B")
    assert rc == 4 and f"every Ascend 910B on this host is in use: {ASCEND_910B}" in err
    b = json.loads(ok("vm", "create", vm("w"), "--passthrough", "K100_AI", "--json"))["allocations"][0]
    assert b["pci_address"] == "0000:8f:00.0"
    assert run("vm", "create", vm("w"), "--passthrough", "Ascend 950")[0] == 3
    # an NVIDIA GPU passed through still needs its seat (licence mode enforce, no pool)
    rc, _, err = run("vm", "create", vm("n"), "--passthrough", "0000:3b:00.0")
    assert rc == 4 and "licence seat" in err


def test_vendor_prepare_bad_input(host: Host) -> None:
    assert run("vendor", "prepare", FLEX, "--vf-memory", "2000")[0] == 2  # needs --vfs
    assert run("vendor", "prepare", ASCEND, "--vfs", "2")[0] == 2  # vNPU VFs are the driver's own
    assert run("vendor", "prepare", MLU, "--vfs", "2", "--vf-memory", "600")[0] == 2  # no quota knob
    assert run("vendor", "prepare", "0000:3b:00.0")[0] == 2  # the T4: no vendor profile
    assert run("vendor", "prepare", "0000:aa:00.0")[0] == 3
    assert run("vendor", "prepare", "zz")[0] == 2
    rc, _, err = run("vendor", "prepare", FLEX, "--vfs", "8", "--vf-memory", "3000")  # 24 GB > 16 000 MiB
    assert rc == 4 and "memory quota of VF 6" in err  # ENOSPC: 5 x 3000 MiB fit, the sixth does not
    assert (host.pci(FLEX) / "sriov_numvfs").read_text() == "0\n"  # nothing enabled after the refusal
    iov = host.pci(FLEX) / "drm/card1/iov"
    assert {(iov / f"vf{n}/gt/lmem_quota").read_text() for n in range(1, 9)} == {"0\n"}  # the five rolled back
    assert (iov / "pf/gt/available/lmem_free").read_text() == f"{16000 << 20}\n"


def test_vnpu_needs_vm_mode_and_shows_its_backing_vf(host: Host) -> None:
    rc, _, err = run("vm", "create", vm("m"), "--vgpu", "vnpu-vir01")
    assert rc == 4 and f"only in VM mode: `vgpumgr vendor prepare {ASCEND}`" in err
    ok("vendor", "prepare", ASCEND)
    a = json.loads(ok("vm", "create", vm("m"), "--vgpu", "vnpu-vir01", "--json"))["allocations"][0]
    listed = ok("mdev", "list")
    assert "BACKING VF" in listed and f"{a['uuid']}  {ASCEND}  vnpu-vir01" in listed and "0000:81:00.1" in listed
    [m] = json.loads(ok("mdev", "list", "--json"))
    assert m["backing_vf"] == "0000:81:00.1"


def test_ascend_mode_refused_while_container_vnpus_exist(host: Host) -> None:
    import subprocess

    subprocess.run([str(host.root / NPU_SMI), "set", "-t", "create-vnpu", "-i", "0", "-c", "0", "-f", "vir02"],
                   check=True, capture_output=True)
    rc, out, err = run("vendor", "prepare", ASCEND)
    assert rc == 4 and "container vNPUs (100)" in err and "destroy-vnpu" in err
    assert "vnpu-mode 0" in ok("vendor", "list")


def test_restore_after_reboot_brings_back_every_vendor_step(host: Host) -> None:
    prepare_all()
    vms = {s: vm("b") for s in ("vnpu-vir02", "mtgpu-2116", "MI300X-CPX", "Flex170-1of8", "ArcProB60-1of4",
                                "MLU370-S4-1of4")}
    for slice_, name in vms.items():
        ok("vm", "create", name, "--vgpu", slice_)
    ok("sim", "reboot")
    rc, out, _ = run("reconcile", "--json")
    missing = set(json.loads(out)["missing"])
    assert rc == 10 and {"0000:87:00.4", "0000:8b:00.4", "0000:8d:00.4"} <= missing  # VFs gone; GIM's came back
    drift = {(d["gpu"], d["step"]) for d in json.loads(out)["vendor_drift"]}
    assert drift == {(ASCEND, "ascend-vnpu-vm-mode"), (FLEX, "i915-lmem-quota"), (BMG, "xe-vram-quota")}
    assert "0000:89:00.4" not in missing and len(missing) == 5  # and the two mdevs
    dry = json.loads(ok("restore", "--dry-run", "--json"))
    steps = {(g["gpu"], s["step"]): s["status"] for g in dry["gpus"] for s in g["steps"]}
    assert steps[(ASCEND, "ascend-vnpu-vm-mode")] == "planned"
    assert steps[(MI300X, "gim-vf-num")] == "ok"
    assert steps[(FLEX, "i915-lmem-quota")] == "planned" and steps[(BMG, "xe-vram-quota")] == "planned"
    done = json.loads(ok("restore", "--json"))
    statuses = {(g["gpu"], s["step"]): s["status"] for g in done["gpus"] for s in g["steps"]}
    assert statuses[(ASCEND, "ascend-vnpu-vm-mode")] == "done" and statuses[(ASCEND, "mdev")] == "done"
    assert statuses[(MTT, "mdev")] == "done"
    assert statuses[(FLEX, "i915-lmem-quota")] == "done" and statuses[(FLEX, "vfs")] == "done"
    assert statuses[(BMG, "xe-vram-quota")] == "done" and statuses[(MLU, "vfs")] == "done"
    iov = host.pci(FLEX) / "drm/card1/iov"
    assert [(iov / f"vf{n}/gt/lmem_quota").read_text() for n in (1, 8)] == [f"{2000 << 20}\n"] * 2
    assert run("reconcile")[0] == 0
    again = json.loads(ok("restore", "--json"))
    assert set(again["counts"]) == {"ok"}


def test_reconcile_fix_after_reboot(host: Host) -> None:
    ok("vendor", "prepare", ASCEND)
    ok("vendor", "prepare", MLU, "--vfs", "4")
    uuid = json.loads(ok("vm", "create", vm("c"), "--vgpu", "vnpu-vir01", "--json"))["allocations"][0]["uuid"]
    ok("vm", "create", vm("c"), "--vgpu", "MLU370-S4-1of4")
    ok("sim", "reboot")
    rc, out, err = run("reconcile", "--fix")
    assert rc != 0 and "VF 0000:87:00.4 is gone" in out + err and "`vgpumgr restore` enables" in out + err
    assert host.mdev(uuid).exists()  # the vNPU is back, the card's VM mode set again first
    ok("restore")
    assert run("reconcile")[0] == 0


def test_reconcile_names_a_vendor_mode_the_reboot_took_with_no_vm_on_the_card(host: Host) -> None:
    ok("vendor", "prepare", ASCEND)
    assert run("reconcile")[0] == 0
    ok("sim", "reboot")
    rc, out, _ = run("reconcile")
    assert rc == 10 and "vendor steps not as recorded: 1" in out, out
    assert f"{ASCEND}  ascend-vnpu-vm-mode: recorded vnpu-mode 1 (VM); now vnpu-mode 0 (container)" in out, out
    ok("restore")
    rc, out, _ = run("reconcile", "--json")
    assert rc == 0 and json.loads(out)["vendor_drift"] == []


def test_amd_restore_checks_the_vf_count_and_names_the_reload(host: Host) -> None:
    ok("vm", "create", vm("a"), "--vgpu", "MI300X-CPX")
    os.unlink(host.root / "etc/modprobe.d/gim.conf")  # GIM now loads with its default vf_num=1
    ok("sim", "reboot")
    rc, out, err = run("restore")
    assert rc == 4
    assert "GIM made 1 VFs (vf_num=1, SPX/NPS1), 8 are recorded" in out
    assert "modprobe -r gim && modprobe gim vf_num=8" in out and "options gim vf_num=8" in out
    assert (host.pci(MI300X) / "sriov_numvfs").read_text() == "1\n"  # never written by vgpumgr
    rc, out, _ = run("vendor", "prepare", MI300X, "--vfs", "8")
    assert rc == 4 and "(CPX/NPS4)" in out


def boot_state(pf: str) -> tuple[int | None, dict[str, Any]]:
    """(numvfs, vendor_state) recorded for `pf`."""
    from sqlalchemy import text

    from vgpumgr.config import Config
    from vgpumgr.db.session import session_factory

    with session_factory(Config.resolve().db_url)() as s:
        row = s.execute(text("SELECT numvfs, vendor_state FROM gpu_boot_state WHERE address = :a"), {"a": pf}).one()
    return row[0], json.loads(row[1]) if isinstance(row[1], str) else (row[1] or {})


def opened_during(fn: Any, *needles: str) -> tuple[Any, Counter[str]]:
    """(fn(), the files whose path holds one of `needles` opened while it ran): Python's audit hook on `open`
    sees every sysfs read, whoever makes it."""
    seen: Counter[str] = Counter()
    active = [True]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if active[0] and event == "open" and isinstance(args[0], str) and any(n in args[0] for n in needles):
            seen[args[0].split("/sys/", 1)[-1]] += 1
    sys.addaudithook(hook)  # cannot be removed: switched off below
    try:
        return fn(), seen
    finally:
        active[0] = False


def test_restore_reads_a_gim_cards_count_once_and_it_is_recorded_once(host: Host) -> None:
    """Issue 42: restore read whether a card's driver fixes its VF count up to three times per GPU (each time its
    PCI ids), and the count was recorded twice (the PF's numvfs and a gim-vf-num vendor step)."""
    ok("vm", "create", vm("a"), "--vgpu", "MI300X-CPX")
    numvfs, vendor_state = boot_state(MI300X)
    assert numvfs == 8 and "gim-vf-num" not in vendor_state
    os.unlink(host.root / "etc/modprobe.d/gim.conf")  # GIM now loads with its default vf_num=1
    ok("sim", "reboot")
    needles = (f"{MI300X}/vendor", f"{MI300X}/device", "gim/parameters/vf_num")
    once = Counter({f"bus/pci/devices/{MI300X}/vendor": 1, f"bus/pci/devices/{MI300X}/device": 1,
                    "module/gim/parameters/vf_num": 1})
    # a real restore also scans the host once first, to keep the VF counts enabled before it ran (issue 38)
    _, one_scan = opened_during(lambda: scan(Host(host.root)), *needles)
    for argv, want in ((("restore", "--dry-run"), once), (("restore",), once + one_scan)):
        (rc, out, _), reads = opened_during(lambda argv=argv: run(*argv), *needles)
        assert rc == 4 and "GIM made 1 VFs (vf_num=1, SPX/NPS1), 8 are recorded" in out
        assert reads == want, reads
    rc, out, _ = run("reconcile", "--json")  # the count recorded once is still checked
    [drift] = json.loads(out)["vendor_drift"]
    assert rc == 10 and drift["gpu"] == MI300X and drift["recorded"] == "GIM VFs 8" and "GIM made 1" in drift["actual"]


def test_a_boot_profile_s_vf_count_on_gim_is_checked_not_written(host: Host, tmp_path: Path) -> None:
    profile = tmp_path / "profile.toml"
    profile.write_text(f'[[gpu]]\naddress = "{MI300X}"\nvfs = 8\n\n[[gpu]]\naddress = "{MLU}"\nvfs = 2\n')
    done = json.loads(ok("restore", "--profile", str(profile), "--json"))
    steps = {(g["gpu"], s["step"]): (s["status"], s["message"]) for g in done["gpus"] for s in g["steps"]}
    assert steps[(MI300X, "gim-vf-num")][0] == "ok" and (MI300X, "vfs") not in steps
    assert steps[(MLU, "vfs")][0] == "done"  # Cambricon's VFs are written through sriov_numvfs
    profile.write_text(f'[[gpu]]\naddress = "{MI300X}"\nvfs = 1\n')
    rc, out, _ = run("restore", "--profile", str(profile))
    assert rc == 4 and "modprobe gim vf_num=1" in out
    assert (host.pci(MI300X) / "sriov_numvfs").read_text() == "8\n"


def test_libvirt_prepare_recreates_a_vnpu_after_reboot(host: Host) -> None:
    from vgpumgr.config import Config
    from vgpumgr.service import Service

    ok("vendor", "prepare", ASCEND)
    name = vm("h")
    uuid = json.loads(ok("vm", "create", name, "--vgpu", "vnpu-vir04", "--json"))["allocations"][0]["uuid"]
    ok("sim", "reboot")
    svc = Service(Config.resolve())
    res = svc.libvirt_prepare(name, svc.vm_xml(name))
    assert res["created"] == [uuid] and host.mdev(uuid).exists()
    assert "vnpu-mode 1 (VM)" in ok("vendor", "list")
    assert "vendor.ascend-vnpu-vm-mode" in ok("audit")


def test_vm_start_after_reboot_sets_vnpu_mode_again(host: Host) -> None:
    ok("vendor", "prepare", ASCEND)
    name = vm("t")
    ok("vm", "create", name, "--vgpu", "vnpu-vir01")
    ok("sim", "reboot")
    ok("vm", "start", name)
    assert "vnpu-mode 1 (VM)" in ok("vendor", "list")


def test_listings_golden(host: Host) -> None:
    from test_cli import golden

    for cmd in (("gpus", "--no-nvml"), ("types",), ("vendor", "list")):
        golden(f"all-{'-'.join(c for c in cmd if not c.startswith('-'))}.txt", ok(*cmd))
        golden(f"all-{'-'.join(c for c in cmd if not c.startswith('-'))}.json", ok(*cmd, "--json"))


def test_demo_profile_all(tmp_path: Path) -> None:
    from test_cli import demo_text, golden

    out = ok("demo", "--profile", "all", "--dir", str(tmp_path / "demo"))
    golden("demo-all.txt", demo_text(out, str(tmp_path / "demo")))  # the same steps and output, whatever its speed
    for name in ("Huawei Ascend 310P", "Huawei Ascend 910B", "Moore Threads MTT S4000", "Cambricon MLU370-S4",
                 "AMD Instinct MI300X", "Intel Data Center GPU Flex 170", "Intel Arc Pro B60", "Hygon DCU K100_AI",
                 "MetaX C500", "Enflame S60", "NVIDIA TU104GL [Tesla T4]"):
        assert name in out
    for vm_name in ("npu1", "mtt1", "mlu1", "mi1", "flex1", "b60", "npu910"):
        assert f"VM {vm_name} defined" in out
    # issue 38: the L40S and A100, which hold no vGPU here, get their VFs back too
    assert "restore: 10 done, 1 ok" in out and "enable 8 VFs on 0000:3d:00.0 (from records)" in out
    assert "demo finished" in out


def test_a_vendor_vf_held_through_iommufd_is_not_released(host: Host) -> None:
    import os

    name = vm("i")
    a = json.loads(ok("vm", "create", name, "--vgpu", "MI300X-CPX", "--json"))["allocations"][0]
    vf = a["pci_address"]
    (host.pci(vf).resolve() / "vfio-dev/vfio9").mkdir(parents=True)  # QEMU with iommufd holds the VF's cdev
    fd = host.root / "proc/4799/fd"
    fd.mkdir(parents=True)
    (fd.parent / "comm").write_text("qemu-system-x86\n")
    os.symlink("/dev/vfio/devices/vfio9", fd / "21")
    rc, _, err = run("release", vf)
    assert rc == 4 and "qemu-system-x86[4799]" in err, err
    assert vf in ok("placements")
