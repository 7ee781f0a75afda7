"""How a driver decides what is creatable: NVIDIA's equal-size rule, GVT-g budgets, sample-driver pools.

Pure functions over a GPU's state and its existing vGPUs, shared by the profile builder (initial
values) and the kernel emulator (after every write).
"""

from __future__ import annotations

from typing import Any


def nvidia_creatable(catalog: list[dict[str, Any]], existing_fb: list[int], *, mig: bool,
                     heterogeneous: bool, total_fb_mb: int, free_gi_profiles: list[str] | None = None
                     ) -> dict[int, int]:
    """Type id -> instances still creatable on the physical GPU (0 = not creatable now).

    Equal-size mode (default): once a vGPU exists only types of the same framebuffer size remain,
    up to their max_instance. Mixed-size mode: any type whose framebuffer still fits. MIG on: only
    MIG-backed types, and only where a free GPU instance of the matching slice count exists.
    """
    out: dict[int, int] = {}
    for t in catalog:
        fb, maxi = t["framebuffer_mb"], t["max_instance"]
        if t.get("mig_slices"):
            if not mig:
                out[t["id"]] = 0
                continue
            free = (free_gi_profiles or []).count(t.get("mig_profile"))
            out[t["id"]] = min(free, maxi)
            continue
        if mig:
            out[t["id"]] = 0
            continue
        if heterogeneous:
            left = total_fb_mb - sum(existing_fb)
            out[t["id"]] = min(maxi - existing_fb.count(fb), left // fb) if fb <= left else 0
            continue
        if existing_fb and any(f != fb for f in existing_fb):
            out[t["id"]] = 0
            continue
        out[t["id"]] = max(0, maxi - len(existing_fb))
    return out


def gvtg_available(types: dict[str, tuple[int, int, int, str, int]], budget: dict[str, int],
                   existing: list[str]) -> dict[str, int]:
    used = {"low_gm": 0, "high_gm": 0, "fence": 0}
    for t in existing:
        low, high, fence, _, _ = types[t]
        used["low_gm"] += low
        used["high_gm"] += high
        used["fence"] += fence
    out = {}
    for name, (low, high, fence, _, _) in types.items():
        out[name] = min((budget["low_gm"] - used["low_gm"]) // low, (budget["high_gm"] - used["high_gm"]) // high,
                        (budget["fence"] - used["fence"]) // fence)
    return out


def pool_available(costs: dict[str, int], budget: int, existing: list[str]) -> dict[str, int]:
    left = budget - sum(costs[t] for t in existing)
    return {t: left // c for t, c in costs.items()}
