"""A vGPU's placement ID as the driver shows it: `nvidia/placement_id` of an mdev's directory or a VF (R570+;
docs/sources.md §21)."""

from __future__ import annotations


def placement_id(device_dir: str) -> int | None:
    """The decimal ID, or None: "Not Applicable", no such file (R550), or ENXIO (a VF without a vGPU)."""
    try:
        with open(f"{device_dir}/nvidia/placement_id") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
