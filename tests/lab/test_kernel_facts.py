"""The kernel facts the simulator copies, checked on the real 6.1 kernel with its sample mdev drivers.

The expectations and their sources: docs/sources.md §1 and §1.1 (types, sysfs layout, errnos; Linux 6.1
`drivers/vfio/mdev/`, `samples/vfio-mdev/`). If one of these fails after a kernel update, the simulator needs the
same change.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import pytest
from lab_sysfs import (
    MDEV_BUS,
    MDEV_DEVICES,
    MdevFactory,
    available,
    existing_mdevs,
    guest_only,
    sysfs_write,
    type_dir,
)

pytestmark = [pytest.mark.lab, guest_only]

# parent -> {type: (name, description or None when the file is absent, default available_instances)}
SAMPLE_TYPES: dict[str, dict[str, tuple[str, str | None, int]]] = {
    "mtty": {
        "mtty-1": ("Single port serial", None, 24),
        "mtty-2": ("Dual port serial", None, 12),
    },
    "mdpy": {
        "mdpy-vga": ("mdpy-vga", "virtual display, 640x480 framebuffer", 4),
        "mdpy-xga": ("mdpy-xga", "virtual display, 1024x768 framebuffer", 4),
        "mdpy-hd": ("mdpy-hd", "virtual display, 1920x1080 framebuffer", 4),
    },
    "mbochs": {
        "mbochs-small": ("mbochs-small", "virtual display, 4 MB video memory", 64),
        "mbochs-medium": ("mbochs-medium", "virtual display, 16 MB video memory", 16),
        "mbochs-large": ("mbochs-large", "virtual display, 64 MB video memory", 4),
    },
}


def counts(parent: str) -> dict[str, int]:
    return {t: available(parent, t) for t in SAMPLE_TYPES[parent]}


def errno_of(path: str | os.PathLike[str], data: str | bytes) -> int:
    with pytest.raises(OSError) as e:
        sysfs_write(path, data)
    return e.value.errno


@pytest.fixture(autouse=True)
def no_leftover_mdevs() -> None:
    # the default counts below are only the defaults on an empty kernel
    assert existing_mdevs() == set(), f"mdevs left behind by an earlier test: {sorted(existing_mdevs())}"


# -- types ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("parent", sorted(SAMPLE_TYPES))
def test_sample_parent_offers_its_types_with_defaults(parent: str) -> None:
    types_dir = MDEV_BUS / parent / "mdev_supported_types"
    assert sorted(p.name for p in types_dir.iterdir()) == sorted(SAMPLE_TYPES[parent])
    for mdev_type, (name, description, default) in SAMPLE_TYPES[parent].items():
        d = types_dir / mdev_type
        assert (d / "name").read_text().strip() == name
        assert (d / "device_api").read_text().strip() == "vfio-pci"
        assert int((d / "available_instances").read_text()) == default
        if description is None:
            assert not (d / "description").exists()
        else:
            assert (d / "description").read_text().strip() == description


def test_mtty_types_share_24_ports_and_mtty_2_costs_two(make_mdev: MdevFactory) -> None:
    make_mdev("mtty", "mtty-2")
    assert counts("mtty") == {"mtty-1": 22, "mtty-2": 11}
    make_mdev("mtty", "mtty-1")
    assert counts("mtty") == {"mtty-1": 21, "mtty-2": 10}


def test_mbochs_types_share_256_mb(make_mdev: MdevFactory) -> None:
    make_mdev("mbochs", "mbochs-large")  # 64 of 256 MB
    assert counts("mbochs") == {"mbochs-small": 48, "mbochs-medium": 12, "mbochs-large": 3}
    make_mdev("mbochs", "mbochs-medium")  # 80 of 256 MB
    assert counts("mbochs") == {"mbochs-small": 44, "mbochs-medium": 11, "mbochs-large": 2}


def test_mdpy_types_share_a_count_of_4(make_mdev: MdevFactory) -> None:
    make_mdev("mdpy", "mdpy-hd")
    assert counts("mdpy") == {"mdpy-vga": 3, "mdpy-xga": 3, "mdpy-hd": 3}


def test_removal_gives_the_capacity_back(make_mdev: MdevFactory) -> None:
    uid = make_mdev("mtty", "mtty-2")
    sysfs_write(MDEV_DEVICES / uid / "remove", "1")
    assert not (MDEV_DEVICES / uid).exists()
    assert counts("mtty") == {"mtty-1": 24, "mtty-2": 12}


# -- errnos ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    ["not-a-uuid", "11111111222233334444555555555555", "11111111-2222-3333-4444-55555555555Z", "\n"],
    ids=["words", "no-dashes", "non-hex", "newline-only"],
)
def test_malformed_uuid_is_einval(raw: str) -> None:
    assert errno_of(type_dir("mtty", "mtty-1") / "create", raw) == errno.EINVAL
    assert existing_mdevs() == set()


def test_zero_byte_write_creates_nothing() -> None:
    sysfs_write(type_dir("mtty", "mtty-1") / "create", b"")
    assert existing_mdevs() == set()
    assert available("mtty", "mtty-1") == 24


@pytest.mark.parametrize("newline", ["", "\n"], ids=["bare", "newline"])
def test_uppercase_uuid_makes_a_lower_case_device(make_mdev: MdevFactory, newline: str) -> None:
    uid = str(uuid.uuid4())
    make_mdev("mtty", "mtty-1", uid.upper() + newline)
    assert existing_mdevs() == {uid}


@pytest.mark.parametrize(("parent", "mdev_type"), [("mtty", "mtty-1"), ("mdpy", "mdpy-vga")])
def test_duplicate_uuid_is_eexist_even_on_another_parent(make_mdev: MdevFactory, parent: str, mdev_type: str) -> None:
    uid = make_mdev("mtty", "mtty-1")
    assert errno_of(type_dir(parent, mdev_type) / "create", uid) == errno.EEXIST
    assert existing_mdevs() == {uid}


@pytest.mark.parametrize(
    ("parent", "fill_type", "fills", "other_type", "expected"),
    [
        ("mtty", "mtty-2", 12, "mtty-1", errno.ENOSPC),  # the driver's own port count, during probe
        ("mbochs", "mbochs-large", 4, "mbochs-small", errno.ENOSPC),  # the driver's memory budget
        ("mdpy", "mdpy-vga", 4, "mdpy-hd", errno.EUSERS),  # the mdev core's max_instances
    ],
    ids=["mtty", "mbochs", "mdpy"],
)
def test_full_parent_refuses_with_its_errno(
    make_mdev: MdevFactory, parent: str, fill_type: str, fills: int, other_type: str, expected: int
) -> None:
    for _ in range(fills):
        make_mdev(parent, fill_type)
    assert set(counts(parent).values()) == {0}
    before = existing_mdevs()
    assert errno_of(type_dir(parent, other_type) / "create", str(uuid.uuid4())) == expected
    assert errno_of(type_dir(parent, fill_type) / "create", str(uuid.uuid4())) == expected
    assert existing_mdevs() == before


def test_available_instances_is_read_only_even_for_root() -> None:
    assert os.geteuid() == 0
    assert errno_of(type_dir("mtty", "mtty-1") / "available_instances", "1") == errno.EACCES


def test_remove_accepts_only_a_boolean_and_twice_is_enoent(make_mdev: MdevFactory) -> None:
    uid = make_mdev("mtty", "mtty-1")
    remove = MDEV_DEVICES / uid / "remove"
    assert errno_of(remove, "abc") == errno.EINVAL
    sysfs_write(remove, "0")  # accepted, and a no-op
    assert (MDEV_DEVICES / uid).exists()
    sysfs_write(remove, "1")
    assert errno_of(remove, "1") == errno.ENOENT


# -- sysfs layout ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("parent", sorted(SAMPLE_TYPES))
def test_parent_is_a_virtual_class_device(parent: str) -> None:
    assert os.readlink(MDEV_BUS / parent) == f"../../devices/virtual/{parent}/{parent}"


def test_mdev_links(make_mdev: MdevFactory) -> None:
    uid = make_mdev("mtty", "mtty-2")
    dev = MDEV_DEVICES / uid
    assert os.readlink(dev) == f"../../../devices/virtual/mtty/mtty/{uid}"
    assert os.readlink(dev / "mdev_type") == "../mdev_supported_types/mtty-2"
    assert dev.joinpath("mdev_type").resolve() == Path("/sys/devices/virtual/mtty/mtty/mdev_supported_types/mtty-2")
    assert dev.joinpath("driver").resolve() == Path("/sys/bus/mdev/drivers/mtty")
    assert os.readlink(type_dir("mtty", "mtty-2") / "devices" / uid) == f"../../../{uid}"
    # 6.1's uevent names only the driver; the type comes from the mdev_type link
    assert (dev / "uevent").read_text().split() == ["DRIVER=mtty"]


def test_each_mdev_gets_its_own_emulated_iommu_group(make_mdev: MdevFactory) -> None:
    groups = []
    for _ in range(2):
        group = (MDEV_DEVICES / make_mdev("mtty", "mtty-1") / "iommu_group").resolve()
        assert group.parent == Path("/sys/kernel/iommu_groups")
        assert Path("/dev/vfio", group.name).is_char_device()
        groups.append(group.name)
    assert len(set(groups)) == 2
