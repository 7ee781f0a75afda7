"""One GPU's MIG state as NVML reported it (the `mig` facts discovery attaches to a GPU), and why a MIG-backed
vGPU finds no GPU instance there, in words. Pure: placement's explanations and the MIG allocator share it.

The reasons, in the order they are decided: MIG is off (only when NVML says so, or says nothing); a GPU
instance of the profile is free; none is free but one can be made (`vgpumgr vm create --mig` makes it); no
room for one, naming the GPU instances that hold the slices its placements need, the VMs whose vGPUs use
them, and how many hold no vGPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vgpumgr.errors import VgpuError
from vgpumgr.mig import plan as mig


@dataclass(frozen=True)
class MigFacts:
    enabled: bool
    table: mig.ProfileTable | None  # None: NVML gave no profiles
    instances: tuple[mig.Placed, ...]
    profiles: tuple[str, ...]  # each instance's profile name, in the order of `instances`

    @classmethod
    def of(cls, nvml: Mapping[str, Any] | None) -> MigFacts | None:
        """From a GPU's NVML facts; None when NVML said nothing about MIG on it."""
        m = (nvml or {}).get("mig") if isinstance(nvml, Mapping) else None
        if not isinstance(m, Mapping) or m.get("current") is None:
            return None
        try:
            table = mig.ProfileTable.from_json(m.get("profiles") or []) if m.get("profiles") else None
        except (KeyError, TypeError, ValueError):
            table = None
        gis, names = [], []
        for gi in m.get("gpu_instances") or []:
            try:
                gis.append(mig.Placed(int(gi["profile_id"]), int(gi["start"]), int(gi["size"]), gi.get("id")))
            except (KeyError, TypeError, ValueError):
                continue
            names.append(str(gi.get("profile") or ""))
        return cls(m.get("current") == "enabled", table, tuple(gis), tuple(names))

    def free(self, used: Iterable[str]) -> list[str]:
        """Profiles of the instances no vGPU uses (`used`: the profiles of the GPU's MIG-backed vGPUs)."""
        names = list(self.profiles)
        for p in used:
            if p in names:
                names.remove(p)
        return names

    def can_make(self, profile: str) -> bool:
        """Whether a GPU instance of `profile` fits next to the existing ones."""
        if not self.enabled or self.table is None:
            return False
        try:
            wanted = self.table.find(profile)
        except VgpuError:
            return False
        return mig.best_start(self.table, list(self.instances), wanted) is not None

    def why_none_free(self, profile: str, users: Sequence[str] = (), used: int = 0) -> str:
        """Why a vGPU needing `profile` finds no free instance here, and whether one can be made."""
        base = f"no free {profile} GPU instance"
        if self.table is None:
            return base
        try:
            wanted = self.table.find(profile)
        except VgpuError:
            return f"{base}; this GPU has no {profile} profile"
        unbound = max(len(self.instances) - used, 0)
        problem = mig.no_room(self.table, list(self.instances), wanted, users, unbound)
        if problem is None:
            return f"{base}; one can be made (`vm create --mig {profile}`)"
        return f"{base}; {problem}"


def users_text(vms: Iterable[str | None]) -> list[str]:
    """["VM ml1", "VM ml2", "1 vGPU without a VM"] for the VMs of a GPU's MIG-backed vGPUs."""
    vms = list(vms)
    named = sorted({v for v in vms if v})
    unnamed = sum(1 for v in vms if not v)
    return [f"VM {v}" for v in named] + ([f"{unnamed} vGPU(s) without a VM"] if unnamed else [])
