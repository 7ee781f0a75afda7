"""Backend contract: what vgpumgr promises for mdevs, proven on the simulator and on a real kernel."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from vgpumgr.backends import mdev
from vgpumgr.backends.common import write
from vgpumgr.discovery.inventory import discover_types
from vgpumgr.discovery.mdev import discover_mdevs
from vgpumgr.errors import Busy, Conflict, InvalidInput, NoCapacity, NotFound
from vgpumgr.hostfs.root import Host

U1 = "c0ffee00-0000-4000-8000-000000000001"
U2 = "c0ffee00-0000-4000-8000-000000000002"


def avail(host: Host, parent: str) -> dict[str, int]:
    return {t.type: t.available_instances for t in discover_types(host, parent)}


def test_virtual_parents_and_their_types_are_discovered(host: Host) -> None:
    types = {(t.parent, t.type): t for t in discover_types(host)}
    for parent, tname in [("mtty", "mtty-1"), ("mtty", "mtty-2"), ("mdpy", "mdpy-vga"), ("mbochs", "mbochs-large")]:
        assert (parent, tname) in types
        t = types[(parent, tname)]
        assert t.device_api == "vfio-pci" and t.backend == "mdev" and t.gpu is None
    assert types[("mtty", "mtty-2")].name == "Dual port serial"
    assert types[("mtty", "mtty-1")].description == ""  # mtty has no description file
    assert types[("mbochs", "mbochs-medium")].description == "virtual display, 16 MB video memory"
    assert avail(host, "mtty") == {"mtty-1": 24, "mtty-2": 12}
    assert avail(host, "mbochs") == {"mbochs-small": 64, "mbochs-medium": 16, "mbochs-large": 4}


def test_create_with_given_uuid_and_remove(host: Host) -> None:
    dev = mdev.create(host, "mtty", "mtty-2", U1)
    assert (dev.uuid, dev.parent, dev.type) == (U1, "mtty", "mtty-2")
    assert dev.iommu_group is not None
    assert [(m.uuid, m.parent, m.type) for m in discover_mdevs(host) if m.uuid == U1] == [(U1, "mtty", "mtty-2")]
    assert avail(host, "mtty") == {"mtty-1": 22, "mtty-2": 11}  # two of 24 shared ports
    assert (host.mdev_type("mtty", "mtty-2") / "devices" / U1).is_symlink()
    assert mdev.remove(host, U1) is True
    assert mdev.get(host, U1) is None
    assert avail(host, "mtty") == {"mtty-1": 24, "mtty-2": 12}


def test_create_with_new_uuid_and_uppercase_uuid(host: Host) -> None:
    dev = mdev.create(host, "mdpy", "mdpy-vga")
    assert mdev.get(host, dev.uuid) is not None
    upper = mdev.create(host, "mdpy", "mdpy-xga", U2.upper())
    assert upper.uuid == U2  # the kernel names the device in lower case
    assert avail(host, "mdpy")["mdpy-hd"] == 2
    mdev.remove(host, dev.uuid)
    mdev.remove(host, U2)


def test_create_is_idempotent_for_same_parent_and_type(host: Host) -> None:
    a = mdev.create(host, "mtty", "mtty-1", U1)
    b = mdev.create(host, "mtty", "mtty-1", U1)
    assert a == b
    assert avail(host, "mtty")["mtty-1"] == 23
    mdev.remove(host, U1)


def test_available_instances_shared_budget_across_types(host: Host) -> None:
    mdev.create(host, "mbochs", "mbochs-medium", U1)  # 16 of 256 MB
    assert avail(host, "mbochs") == {"mbochs-small": 60, "mbochs-medium": 15, "mbochs-large": 3}
    mdev.create(host, "mbochs", "mbochs-large", U2)  # 64 more
    assert avail(host, "mbochs") == {"mbochs-small": 44, "mbochs-medium": 11, "mbochs-large": 2}
    mdev.remove(host, U1)
    mdev.remove(host, U2)
    assert avail(host, "mbochs") == {"mbochs-small": 64, "mbochs-medium": 16, "mbochs-large": 4}


def test_duplicate_uuid_across_parents_is_a_conflict(host: Host) -> None:
    mdev.create(host, "mtty", "mtty-1", U1)
    with pytest.raises(Conflict, match="already exists"):
        mdev.create(host, "mdpy", "mdpy-vga", U1)
    # the kernel itself says EEXIST when asked directly
    with pytest.raises(Conflict) as e:
        write(host, host.mdev_type("mdpy", "mdpy-vga") / "create", U1, "raw create")
    assert e.value.detail["errno"] == "EEXIST"
    mdev.remove(host, U1)


@pytest.mark.parametrize("bad", ["not-a-uuid", "c0ffee000000400080000000000000001", "../../../etc/passwd", ""])
def test_bad_uuid_is_refused_before_any_write(host: Host, bad: str) -> None:
    with pytest.raises(InvalidInput, match="not a UUID"):
        mdev.create(host, "mtty", "mtty-1", bad or " ")
    assert discover_mdevs(host) == [] or all(m.uuid != bad for m in discover_mdevs(host))


@pytest.mark.parametrize("raw", ["not-a-uuid\n", "c0ffee00-0000-4000-8000-00000000000Z", "\n"])
def test_kernel_rejects_malformed_create_with_einval(host: Host, raw: str) -> None:
    with pytest.raises(InvalidInput) as e:
        write(host, host.mdev_type("mtty", "mtty-1") / "create", raw, "raw create")
    assert e.value.detail["errno"] == "EINVAL"


def test_zero_byte_create_creates_nothing(host: Host) -> None:
    before = discover_mdevs(host)
    write(host, host.mdev_type("mtty", "mtty-1") / "create", "", "raw create")
    assert discover_mdevs(host) == before


def test_no_instances_left(host: Host) -> None:
    made = [mdev.create(host, "mdpy", "mdpy-hd").uuid for _ in range(4)]
    assert avail(host, "mdpy") == {"mdpy-vga": 0, "mdpy-xga": 0, "mdpy-hd": 0}
    with pytest.raises(NoCapacity, match="no mdpy-vga instances left"):
        mdev.create(host, "mdpy", "mdpy-vga")
    with pytest.raises(NoCapacity) as e:  # the kernel's own answer: EUSERS from the mdev core
        write(host, host.mdev_type("mdpy", "mdpy-vga") / "create", U1, "raw create")
    assert e.value.detail["errno"] == "EUSERS"
    for _ in range(12):
        made.append(mdev.create(host, "mtty", "mtty-2").uuid)
    with pytest.raises(NoCapacity) as e:  # mtty's driver refuses in probe: ENOSPC
        write(host, host.mdev_type("mtty", "mtty-1") / "create", U2, "raw create")
    assert e.value.detail["errno"] == "ENOSPC"
    for u in made:
        mdev.remove(host, u)


def test_remove_unknown_device(host: Host) -> None:
    assert mdev.remove(host, U2) is False
    with pytest.raises(NotFound) as e:  # a second `remove` write on a vanished device: ENOENT
        dev = mdev.create(host, "mtty", "mtty-1", U1)
        path = host.mdev(dev.uuid) / "remove"
        write(host, path, "1", "raw remove")
        write(host, Path(path), "1", "raw remove again")
    assert e.value.detail["errno"] == "ENOENT"


def test_remove_value_semantics(host: Host) -> None:
    mdev.create(host, "mtty", "mtty-1", U1)
    write(host, host.mdev(U1) / "remove", "0", "remove 0")  # a no-op
    assert mdev.get(host, U1) is not None
    with pytest.raises(InvalidInput):
        write(host, host.mdev(U1) / "remove", "abc", "remove abc")
    mdev.remove(host, U1)


def test_available_instances_is_read_only(host: Host) -> None:
    with pytest.raises(Exception) as e:
        write(host, host.mdev_type("mtty", "mtty-1") / "available_instances", "1", "write available")
    assert getattr(e.value, "detail", {}).get("errno") == "EACCES"


def test_remove_of_a_held_device_is_refused_quickly_naming_the_holder(host: Host, hold) -> None:  # noqa: ANN001
    dev = mdev.create(host, "mtty", "mtty-1", U1)
    holder = hold(dev.iommu_group)
    t0 = time.monotonic()
    with pytest.raises(Busy) as e:
        mdev.remove(host, U1)
    assert time.monotonic() - t0 < 2.0
    assert holder in e.value.message
    assert mdev.get(host, U1) is not None  # nothing was written: the device is intact


def test_unknown_parent_and_type(host: Host) -> None:
    with pytest.raises(NotFound, match="no mdev parent"):
        mdev.create(host, "nosuch", "mtty-1")
    with pytest.raises(NotFound, match="offers no type"):
        mdev.create(host, "mtty", "mtty-9")
    with pytest.raises(InvalidInput):
        mdev.create(host, "mtty", "../../x")
