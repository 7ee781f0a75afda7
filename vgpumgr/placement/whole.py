"""Choosing a whole device by model (`vm create --passthrough "Ascend 910B"`): pure, as placement/placer.py.

A card is a candidate when it is a physical function that can be passed through and its name (as `gpus` shows it)
or its model in the vendor table matches; it is taken when vgpumgr has a live allocation on it or the host shows
vGPUs on it. The lowest free address is chosen; every other candidate is named with its reason."""

from __future__ import annotations

from collections.abc import Collection

from vgpumgr.errors import NoCapacity, NotFound
from vgpumgr.model import BACKEND_PASSTHROUGH, Inventory
from vgpumgr.vendors import profiles as vendors


def matches(wanted: str, name: str, vendor: str, device: str) -> bool:
    w = wanted.strip().lower()
    p = vendors.profile(vendor, device)
    names = {name.lower()} | ({p.model.lower(), p.name.lower()} if p else set())
    return w in names or any(n.endswith(" " + w) for n in names)


def pick(inv: Inventory, busy: Collection[str], wanted: str) -> tuple[str, list[tuple[str, str]]]:
    """(address, [(address, why not)]) for a free whole device of model `wanted`; NotFound when the host has no
    such model, NoCapacity when every one is taken."""
    used = set(busy) | {m.gpu for m in inv.mdevs if m.gpu} | {v.gpu for v in inv.vf_vgpus}
    candidates = sorted((g for g in inv.gpus if not g.is_vf and BACKEND_PASSTHROUGH in g.backends
                         and matches(wanted, g.name, g.vendor_id, g.device_id)), key=lambda g: g.address)
    if not candidates:
        raise NotFound(f"no device of model '{wanted}' on this host to pass through",
                       hint="`vgpumgr gpus` lists the models; or give its PCI address to --passthrough")
    rejected = [(g.address, "in use (a VM's passthrough or vGPUs on it)") for g in candidates if g.address in used]
    free = [g.address for g in candidates if g.address not in used]
    if not free:
        raise NoCapacity(f"every {wanted} on this host is in use: "
                         + "; ".join(f"{a}: {why}" for a, why in rejected),
                         hint="release one (`vgpumgr vm delete`) or choose another model")
    return free[0], rejected
