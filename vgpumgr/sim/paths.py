"""Where a simulated host keeps the state that lives beside its sysfs tree."""

from __future__ import annotations

from pathlib import Path

NVML_STATE = ".vgpumgr-nvml.json"


def nvml_state_path(root: str | Path) -> Path:
    return Path(root) / NVML_STATE
