"""Small, fast sysfs readers (os-level calls: discovery reads thousands of tiny files)."""

from __future__ import annotations

import os


def read(path: str, default: str | None = None) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return default
    try:
        return os.read(fd, 65536).decode("utf-8", "replace").strip()
    except OSError:
        return default
    finally:
        os.close(fd)


def read_id(path: str) -> str | None:
    """A PCI id file (`vendor`, `device`, `subsystem_*`, `sriov_vf_device`) as ids are spelt everywhere else:
    "0x19E5" -> "19e5"; None where the file is missing or empty."""
    s = read(path)
    return s.lower().removeprefix("0x") if s else None


def read_int(path: str, default: int | None = None) -> int | None:
    s = read(path)
    if s is None:
        return default
    try:
        return int(s, 0)
    except ValueError:
        return default


def link_name(path: str) -> str | None:
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def virtfns(device_dir: str, numvfs: int | None = None) -> list[str]:
    """A PF's VF addresses from its `virtfnN` links (`sriov_numvfs` of them, read unless given)."""
    n = (read_int(f"{device_dir}/sriov_numvfs", 0) or 0) if numvfs is None else numvfs
    return [v for v in (link_name(f"{device_dir}/virtfn{i}") for i in range(n)) if v]
