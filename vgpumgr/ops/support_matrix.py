"""NVIDIA's vGPU support matrix as far as public sources say (support_matrix.json beside this file; its rows
name their sources, docs/sources.md §26): which branch a driver version belongs to, whether a branch supports a
card on the host side, which kernels a branch or version is known not to build on. `doctor` and `upgrade check`
read it; "unknown" is an answer, never taken for yes or no."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

YES, NO, NVAIE, UNKNOWN = "yes", "no", "nvaie", "unknown"


@cache
def data() -> dict[str, Any]:
    return json.loads((Path(__file__).parent / "support_matrix.json").read_text())


def version_tuple(version: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version or ""))


def branch_of(version: str | None) -> str | None:
    """'R550' for '550.90.05'; None when the text is no driver version."""
    m = re.match(r"\s*(\d{3})\.", version or "")
    return f"R{m.group(1)}" if m else None


def branch_info(branch: str | None) -> dict[str, Any] | None:
    return next((b for b in data()["branches"] if b["branch"] == branch), None)


def release_name(branch: str | None) -> str:
    """'R550 (vGPU 17.x)' or just the branch when the matrix does not know it."""
    b = branch_info(branch)
    return f"{branch} (vGPU {b['release']}.x)" if b else (branch or "unknown")


@dataclass(frozen=True)
class Support:
    answer: str  # yes | no | nvaie | unknown
    family: str | None
    models: str | None
    source: str | None
    mig: bool = False

    def words(self, card: str, branch: str | None) -> str:
        where = release_name(branch)
        if self.answer == YES:
            return f"{where} supports {card} ({self.family})"
        if self.answer == NO:
            return f"{where} does not support {card} ({self.family})"
        if self.answer == NVAIE:
            return f"{where} supports {card} ({self.family}) only under NVIDIA AI Enterprise"
        if self.family is None:
            return f"no public source says whether {where} supports {card} (PCI device not in the support matrix)"
        return f"no public source says whether {where} supports {card} ({self.family})"


def family_of(device_id: str) -> dict[str, Any] | None:
    d = device_id.lower()  # as discovery spells it (discovery.fs.read_id): "26b9"
    return next((f for f in data()["families"] if d in f["devices"]), None)


def support(device_id: str, branch: str | None) -> Support:
    fam = family_of(device_id)
    if fam is None:
        return Support(UNKNOWN, None, None, None)
    answer = fam["support"].get(branch or "", UNKNOWN)
    return Support(answer, fam["family"], fam["models"], fam["source"], bool(fam.get("mig")))


def supported_branches(device_id: str) -> list[str]:
    fam = family_of(device_id)
    return [b for b, a in (fam or {}).get("support", {}).items() if a == YES]


def kernel_breakages(kernel: str | None, version: str | None) -> list[dict[str, Any]]:
    """The known breakages of driver `version` on `kernel` (empty when none is known, which is not "works")."""
    k, branch = version_tuple(kernel), branch_of(version)
    if not k or branch is None:
        return []
    out = []
    for row in data()["kernel_breakages"]:
        if k < version_tuple(row["kernel_from"]):
            continue
        if version in row.get("versions", ()) or branch in row.get("branches", ()):
            out.append(row)
    return out


def feature(name: str) -> dict[str, Any]:
    return next(f for f in data()["features"] if f["feature"] == name)


def branch_number(branch: str | None) -> int:
    return int(branch[1:]) if branch and branch[1:].isdigit() else 0
