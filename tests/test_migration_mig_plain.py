"""A MIG-backed VM moved by plain libvirt (`virsh migrate`, Nova, Proxmox): the destination's hook gets the
domain's XML as `vgpumgr vm xml` shows it, without the migration facts `vgpumgr vm migrate` adds, and must
still know the vGPU needs a GPU instance (from its type's name and vgpumgr's record), reserve or make one,
and refuse only with the true reason (issue 30)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hookserver import LIBVIRT, run
from lxml import etree
from migration_hosts import SimHost, sim_hosts

from vgpumgr.errors import InvalidInput, NoCapacity
from vgpumgr.sim.libvirtd import SimMigration
from vgpumgr.virt import domain
from vgpumgr.virt import migration_xml as migration
from vgpumgr.virt.domain import NS

A100 = "0000:65:00.0"
A100_2 = "0000:67:00.0"  # the second A100 of `--scale 2`


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[SimHost]]:
    with sim_hosts(tmp_path, "a100-mig", "a100-mig") as hosts:
        yield hosts


def instances(h: SimHost, gpu: str = A100) -> list[str]:
    """The GPU instances on a host's GPU, by profile, as NVML reports them now."""
    return [gi["profile"] for gi in h.svc.nvml().gpus()[gpu]["mig"]["gpu_instances"]]


def hook(h: SimHost, name: str, op: str, sub: str, xml: str):  # noqa: ANN201
    return run([str(LIBVIRT), name, op, sub, "-"], h.server.env(), xml)


def without_mig_profile(xml: str) -> str:
    """The XML of a VM made before vgpumgr recorded the profile: only the type names it."""
    root = etree.fromstring(xml)
    for f in root.iterfind(f"metadata/{{{NS}}}vm/{{{NS}}}allocation/{{{NS}}}field[@name='mig_profile']"):
        f.getparent().remove(f)
    return etree.tostring(root, encoding="unicode")


def test_virsh_migrate_of_a_mig_vm_makes_a_gpu_instance_at_the_destination(pair: list[SimHost]) -> None:
    a, b = pair
    b.svc.create_vm("other", mig=["1g.10gb"], start=True)  # B already runs a MIG-backed VM
    a.svc.create_vm("ml1", mig=["1g.10gb"], start=True)
    [src] = a.live("ml1")
    xml = a.svc.vm_xml("ml1")
    [record] = domain.read_allocations(xml)
    assert record["mig_profile"] == "1g.10gb" and migration.MIGRATION_KEY not in record  # what virsh carries

    SimMigration(b.uri).migrate(a.svc, "ml1", b.uri)  # libvirt's own order, hooks included: no vgpumgr source

    [there] = b.live("ml1")
    assert there["mig_profile"] == "1g.10gb" and there["type_name"] == src["type_name"]
    assert there["state"] == "active" and there["gpu"] == A100
    assert instances(b) == ["1g.10gb", "1g.10gb"]  # one made for it next to the other VM's
    assert b.domains()["ml1"] == "running" and "ml1" not in a.domains()
    assert a.live("ml1") == []  # the source's `release end` freed it there
    with b.svc.virt() as v:
        dest_xml = v.xml("ml1")
    assert domain.referenced_devices(dest_xml)["mdev"] == [there["uuid"]]
    assert domain.read_allocations(dest_xml)[0]["mig_profile"] == "1g.10gb"


def test_the_hook_reuses_a_free_instance_or_makes_one_and_knows_the_profile_from_the_type(
        pair: list[SimHost]) -> None:
    a, b = pair
    a.svc.create_vm("ml1", mig=["1g.10gb"], start=True)
    xml = without_mig_profile(a.svc.vm_xml("ml1"))  # a VM made by an older vgpumgr: the type name alone
    assert "mig_profile" not in domain.read_allocations(xml)[0]

    # none there: one is made
    assert instances(b) == []
    r = hook(b, "ml1", "migrate", "begin", xml)
    assert r.returncode == 0, r.stderr
    [mine] = b.live("ml1")
    assert mine["state"] == "reserved" and mine["mig_profile"] == "1g.10gb" and instances(b) == ["1g.10gb"]
    assert domain.referenced_devices(r.stdout)["mdev"] == [mine["uuid"]]
    # the migration fails: libvirt ends it with `release end`, which frees the vGPU; its instance stays
    assert hook(b, "ml1", "release", "end", r.stdout).returncode == 0
    assert b.live("ml1") == [] and instances(b) == ["1g.10gb"]

    # a free one there: it is reused, none is made
    r = hook(b, "ml1", "migrate", "begin", xml)
    assert r.returncode == 0, r.stderr
    assert [x["mig_profile"] for x in b.live("ml1")] == ["1g.10gb"] and instances(b) == ["1g.10gb"]
    assert not [e for e in b.events("mig.gi.create") if e.vm == "ml1"][1:]  # only the first attempt made one


def test_a_full_gpu_refuses_with_what_holds_its_slices_and_place_explain_says_the_same(
        pair: list[SimHost], monkeypatch: pytest.MonkeyPatch) -> None:
    from simhost import run as cli
    from test_cli import golden

    a, b = pair
    monkeypatch.setenv("VGPUMGR_HOSTNAME", b.name)  # the CLI reads B's records
    a.svc.create_vm("ml1", mig=["1g.10gb"], start=True)
    xml = a.svc.vm_xml("ml1")
    args = ("--sysfs-root", str(b.server.root), "--state-dir", str(b.server.cfg.state_dir),
            "--connect", b.server.cfg.libvirt_uri)

    # MIG on, no instance yet: placement says one can be made, not that MIG is off
    rc, out, _ = cli(*args, "place", "--type", "A100D-1-10C", "--explain")
    assert rc == 4 and "no free 1g.10gb GPU instance; one can be made (`vm create --mig 1g.10gb`)" in out
    assert "MIG is not enabled" not in out

    b.svc.create_vm("big", mig=["4g.40gb"], start=True)
    b.svc.create_vm("half", mig=["3g.40gb"], start=True)  # every memory slice is taken now
    before = (b.live(), b.devices(), instances(b))
    r = hook(b, "ml1", "migrate", "begin", xml)
    assert r.returncode == 1 and not r.stdout
    assert "no room for a 1g.10gb instance (slices 0-6 taken by 4g.40gb (GI " in r.stderr, r.stderr
    assert "3g.40gb (GI " in r.stderr and "MIG-backed vGPUs of VM big, VM half" in r.stderr
    assert "MIG is not enabled" not in r.stderr
    assert (b.live(), b.devices(), instances(b)) == before  # nothing reserved, nothing made

    rc, out, _ = cli(*args, "place", "--type", "A100D-1-10C", "--explain")
    assert rc == 4
    golden("place-explain-mig-full.txt", out)


def test_two_mig_vgpus_arrive_on_two_gpus_and_a_full_one_is_named(tmp_path: Path) -> None:
    with sim_hosts(tmp_path, "a100-mig", "a100-mig", scale=2) as (a, b):
        a.svc.create_vm("duo", mig=["1g.10gb", "2g.20gb"], start=True)
        assert sorted(x["gpu"] for x in a.live("duo")) == [A100, A100_2]  # one vGPU of a GPU per VM
        xml = a.svc.vm_xml("duo")

        # B's first GPU is full: the second cannot take both, and the refusal says why for each GPU
        b.svc.create_vm("big", mig=["7g.80gb"], start=True, policy=_pin(A100))
        before = (b.live(), b.devices(), instances(b, A100_2))
        r = hook(b, "duo", "migrate", "begin", xml)
        assert r.returncode == 1, r.stdout
        assert (f"no GPU has room for a 2g.20gb GPU instance: {A100}: no free 2g.20gb GPU instance; no room for a "
                "2g.20gb instance (slices 0-5 taken by 7g.80gb (GI 1); MIG-backed vGPUs of VM big)") in r.stderr
        assert f"{A100_2}: VM duo already has a vGPU on this GPU" in r.stderr
        assert "MIG is not enabled" not in r.stderr
        assert (b.live(), b.devices(), instances(b, A100_2)) == before  # all or nothing

        # with room on both, each vGPU gets an instance of its profile on its own GPU
        b.svc.delete_vm("big")
        b.svc.nvml().destroy_gpu_instance(A100, b.svc.nvml().gpus()[A100]["mig"]["gpu_instances"][0]["id"])
        b.svc.host.kernel.gpu_instances_changed(b.svc.nvml())
        b.svc.invalidate()
        r = hook(b, "duo", "migrate", "begin", xml)
        assert r.returncode == 0, r.stderr
        got = sorted((x["gpu"], x["mig_profile"]) for x in b.live("duo"))
        assert len({gpu for gpu, _ in got}) == 2 and sorted(p for _, p in got) == ["1g.10gb", "2g.20gb"]
        assert sorted(instances(b, A100) + instances(b, A100_2)) == ["1g.10gb", "2g.20gb"]
        assert len(domain.referenced_devices(r.stdout)["mdev"]) == 2


def test_mig_off_is_named_only_where_mig_is_off_and_a_contradicting_record_is_refused(tmp_path: Path) -> None:
    """In process (the service the hook calls): a Hopper destination rebooted without its MIG mode restored."""
    from test_hot_path import make_service

    from vgpumgr.sim.reboot import reboot

    a = make_service(tmp_path / "a", "h100-mig", vfs=4)
    b = make_service(tmp_path / "b", "h100-mig", vfs=4)
    a.create_vm("ml1", mig=["1g.10gb"])
    xml = a.vm_xml("ml1")
    reboot(b.host.root)  # Hopper's MIG mode does not survive a reboot
    b.invalidate()
    with pytest.raises(NoCapacity, match="MIG is not enabled"):
        b.libvirt_migrate("ml1", xml)
    assert b.allocations(live=True) == []
    contradicting = xml.replace(">1g.10gb<", ">3g.40gb<")
    assert contradicting != xml
    with pytest.raises(InvalidInput, match="its type needs 1g.10gb"):
        b.libvirt_migrate("ml1", contradicting)


def _pin(gpu: str):  # noqa: ANN202
    from vgpumgr.placement.placer import Policy

    return Policy(pin_gpu=gpu)
