"""Fixtures for tests that run inside the mdev lab guest (scripts/mdev-lab), on the real kernel."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import pytest
from lab_sysfs import MDEV_DEVICES, MdevFactory, existing_mdevs, sysfs_write, type_dir


@pytest.fixture
def make_mdev() -> Iterator[MdevFactory]:
    """make_mdev(parent, type, uuid=None) creates an mdev through `create`; all are removed afterwards.

    The contract suite runs in the same boot, so anything left behind here would skew its counts.
    """
    before = existing_mdevs()

    def _make(parent: str, mdev_type: str, uid: str | None = None) -> str:
        uid = uid or str(uuid.uuid4())
        sysfs_write(type_dir(parent, mdev_type) / "create", uid)
        return uid.lower()

    yield _make
    for leftover in existing_mdevs() - before:
        with contextlib.suppress(FileNotFoundError):
            sysfs_write(MDEV_DEVICES / leftover / "remove", "1")
