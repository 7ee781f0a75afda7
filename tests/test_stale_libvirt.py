"""Issue 24 on the libvirt hook path: a record whose domain is gone from libvirt (its `release end` hook lost)
and whose device nobody holds is reported by `reconcile` and released by `reconcile --fix`.

The hook script runs as libvirtd runs it (`qemu <domain> <op> <sub-op> -`, the XML on stdin) against the real
service; libvirt is the test driver, whose domains every `Virt` saves for other processes to see.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hookserver import LIBVIRT, Server, run, running_server
from lxml import etree
from simhost import run as cli

from vgpumgr.audit import chain as audit
from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.config import Config
from vgpumgr.licensing import seats as licensing
from vgpumgr.ops import stale
from vgpumgr.service import Service
from vgpumgr.virt import domain
from vgpumgr.virt.driver import Virt

GPU = "0000:3d:00.0"  # the second T4


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with running_server(tmp_path, "t4", scale=2, licence_mode="enforce") as srv:
        with Service(srv.cfg).tx() as s:
            licensing.add_pool(s, name="ws", edition_name="vWS", seats=4)
        yield srv


def domain_xml(name: str, uuid: str, vm_uuid: str) -> str:
    d = domain.build(domain.VmSpec(name, uuid=vm_uuid, hostdevs=[domain.Hostdev("mdev", uuid=uuid)]))
    d.set_allocations([{"uuid": uuid, "backend": "mdev", "parent": GPU, "type": "nvidia-233"}])
    return etree.tostring(d.element, encoding="unicode")


def virt(server: Server) -> Virt:
    return Virt(server.cfg.libvirt_uri, state_dir=server.cfg.state_dir)


def start(server: Server, name: str, uuid: str, vm_uuid: str) -> str:
    """libvirt's start of a defined domain: `prepare begin` (the hook makes the mdev), then QEMU runs."""
    xml = domain_xml(name, uuid, vm_uuid)
    with virt(server) as v:
        v.define(xml, validate=False)
    r = run([str(LIBVIRT), name, "prepare", "begin", "-"], server.env(), xml)
    assert r.returncode == 0, r.stderr
    with virt(server) as v:
        v.start(name)
    return xml


def reconcile(server: Server, *extra: str) -> tuple[int, dict[str, Any]]:
    rc, out, err = cli("reconcile", "--sysfs-root", str(server.root), "--state-dir", str(server.cfg.state_dir),
                       "--connect", server.cfg.libvirt_uri, "--json", *extra)
    assert not err, err
    return rc, json.loads(out)


def seats_used(server: Server) -> int:
    with Service(server.cfg).sessions() as s:
        return sum(e.used for e in licensing.usage(s))


def hold(server: Server, uuid: str) -> Path:
    """A process of the simulated host holds the mdev's VFIO group open (as a QEMU would)."""
    dev = mdev_backend.get(Service(server.cfg).host, uuid)
    assert dev is not None and dev.iommu_group is not None
    proc = server.root / "proc/7100"
    (proc / "fd").mkdir(parents=True)
    (proc / "comm").write_text("qemu-system-x86\n")
    os.symlink(f"/dev/vfio/{dev.iommu_group}", proc / "fd/30")
    return proc


UUID_A, VM_A = "8f7c3c52-1d6e-4a3c-9f1e-2b0d7d5a9c10", "0b6f0c2e-2f4a-4d7e-9a51-1c2d3e4f5a01"
UUID_B, VM_B = "5d1e2f3a-4b5c-4d6e-8f7a-9b0c1d2e3f40", "0b6f0c2e-2f4a-4d7e-9a51-1c2d3e4f5a02"


def test_a_lost_release_end_of_a_domain_that_is_gone(server: Server) -> None:
    start(server, "lv1", UUID_A, VM_A)
    start(server, "lv2", UUID_B, VM_B)
    never = Service(server.cfg).allocate("T4-2Q", vm="later")  # a VM libvirt never had: not judged
    assert seats_used(server) == 3
    assert reconcile(server) == (0, reconcile(server)[1]) and reconcile(server)[1]["stale_records"] == []

    with virt(server) as v:  # both stop; their release end hooks are lost
        v.stop("lv1")
        v.stop("lv2")
        v.undefine("lv1")  # lv1 was transient, or undefined by hand; lv2 stays defined
    rc, r = reconcile(server)
    assert rc == 10 and r["missing"] == [] and r["unknown"] == [] and r["stale_unchecked"] is None
    [st] = r["stale_records"]
    assert (st["vgpu"], st["vm"], st["kind"], st["type"]) == (UUID_A, "lv1", "libvirt", "nvidia-233")
    assert st["evidence"] == {"domain": f"libvirt ({server.cfg.libvirt_uri}) has no domain lv1 or with UUID {VM_A}",
                              "domains_using_device": [], "holders": []}
    rc, text, _ = cli("reconcile", "--sysfs-root", str(server.root), "--state-dir", str(server.cfg.state_dir),
                      "--connect", server.cfg.libvirt_uri)
    assert rc == 10 and f"  {UUID_A}  nvidia-233 for VM lv1 (libvirt)\n" in text and "has no domain lv1" in text

    holder = hold(server, UUID_A)  # something still has the mdev open: not released, not even reported
    assert reconcile(server)[1]["stale_records"] == []
    assert reconcile(server, "--fix")[1]["stale_records"] == [] and UUID_A in server.mdevs()
    holder.joinpath("fd/30").unlink()

    rc, r = reconcile(server, "--fix")
    assert rc == 0 and [(x["vgpu"], x["action"], x["device_removed"], x["licence_returned"])
                        for x in r["stale_records"]] == [(UUID_A, "released", True, "vWS")]
    assert UUID_A not in server.mdevs() and UUID_B in server.mdevs()
    assert [a["vm"] for a in Service(server.cfg).allocations(live=True)] == ["lv2", "later"]
    assert seats_used(server) == 2
    with Service(server.cfg).sessions() as s:
        [e] = audit.query(s, vm="lv1", action=stale.RELEASE_STALE)
    assert e.outcome == "ok" and e.vgpu == UUID_A and "has no domain lv1" in e.detail["evidence"]["domain"]
    assert reconcile(server)[0] == 0
    # the release end hook arrives after all: nothing left to release
    assert run([str(LIBVIRT), "lv1", "release", "end", "-"], server.env(),
               domain_xml("lv1", UUID_A, VM_A)).returncode == 0
    assert never["uuid"] in server.mdevs()


def test_a_domain_that_names_the_device_keeps_it(server: Server) -> None:
    start(server, "lv1", UUID_A, VM_A)
    with virt(server) as v:
        v.stop("lv1")
        v.undefine("lv1")
        v.define(domain_xml("lv1-renamed", UUID_A, VM_B), validate=False)  # another domain uses the mdev now
    assert reconcile(server)[1]["stale_records"] == []
    with virt(server) as v:
        v.undefine("lv1-renamed")
    assert [x["vgpu"] for x in reconcile(server)[1]["stale_records"]] == [UUID_A]


def test_a_domain_prepared_again_meanwhile_keeps_its_record(server: Server) -> None:
    xml = start(server, "lv1", UUID_A, VM_A)
    with virt(server) as v:
        v.stop("lv1")
        v.undefine("lv1")
    svc = Service(server.cfg)
    [found], _ = stale.find(svc)
    with virt(server) as v:  # defined and started again before the release: its prepare runs
        v.define(xml, validate=False)
    assert run([str(LIBVIRT), "lv1", "prepare", "begin", "-"], server.env(), xml).returncode == 0
    done = stale.release(svc, found)
    assert done["action"] == "kept" and "prepared again" in done["why"]
    assert UUID_A in server.mdevs() and len(svc.allocations(vm="lv1", live=True)) == 1


def test_libvirt_out_of_reach_judges_nothing(server: Server, tmp_path: Path) -> None:
    start(server, "lv1", UUID_A, VM_A)
    with virt(server) as v:
        v.stop("lv1")
        v.undefine("lv1")
    down = f"qemu+unix:///system?socket={tmp_path}/no-libvirt.sock"
    cfg = Config.resolve(sysfs_root=str(server.root), state_dir=str(server.cfg.state_dir), connect=down)
    r = Service(cfg).reconcile(fix=True)
    assert r["stale_records"] == [] and "libvirt could not be asked" in r["stale_unchecked"]
    assert UUID_A in server.mdevs()
    rc, text, _ = cli("reconcile", "--sysfs-root", str(server.root), "--state-dir", str(server.cfg.state_dir),
                      "--connect", down)
    assert rc == 0 and "  not checked: libvirt could not be asked" in text


def test_a_vm_created_by_vgpumgr_and_undefined_behind_its_back(tmp_path: Path) -> None:
    from vgpumgr.sim import profiles

    root = profiles.create(tmp_path / "sim", "t4")
    svc = Service(Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "state"), connect="test:///default"))
    vm = svc.create_vm("web1", vgpus=["T4-4Q"], start=True)
    [rec] = svc.allocations(vm="web1", live=True)
    assert svc.reconcile()["stale_records"] == []  # running
    with svc.virt() as v:
        v.stop("web1")
    assert svc.reconcile()["stale_records"] == []  # stopped, still defined: its next start uses the mdev
    with svc.virt() as v:
        v.undefine("web1")  # `virsh undefine`, not `vgpumgr vm delete`
    [st] = svc.reconcile()["stale_records"]
    assert (st["vgpu"], st["vm"], st["kind"]) == (rec["uuid"], "web1", "libvirt") and vm["name"] == "web1"
    [done] = svc.reconcile(fix=True)["stale_records"]
    assert done["action"] == "released" and done["device_removed"] is True
    assert svc.allocations(live=True) == [] and mdev_backend.get(svc.host, rec["uuid"]) is None
