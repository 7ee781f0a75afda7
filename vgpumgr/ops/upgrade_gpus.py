"""`upgrade check --kernel K --driver V`, per GPU: what the planned kernel and NVIDIA driver would break, from the
support matrix (ops/support_matrix.json): a branch that does not support the card, a kernel the driver is known
not to build on, mixed-size mode (R550 and newer) and MIG-backed vGPU (NVIDIA AI Enterprise only from R570) lost.

Guests outside NVIDIA's guest/host driver window are another rule's (issue 40): `check` takes it as `guests`, a
callable given (VM name, planned host driver) for each VM with vGPUs here, returning its findings; without one,
nothing is said of the guests' drivers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vgpumgr import ids
from vgpumgr.nvidia import mixed
from vgpumgr.ops import support_matrix as sm

NVIDIA = "10de"
GuestRule = Callable[[str, str], Sequence[Any]]


def gpus(cfg: Any) -> list[Any]:
    from vgpumgr.discovery.pci import discover_gpus
    from vgpumgr.nvidia.facts import merge_nvml

    found = discover_gpus(cfg.host)
    merge_nvml(cfg, found, quiet=True)
    return [g for g in found if g.vendor_id == NVIDIA and g.physfn is None]


def check(say: Callable[[str, str, str], None], cfg: Any, records: list[tuple[Any, ...]], running: str | None,
          kernel: str | None, driver: str | None, boot_modes: dict[str, str], guests: GuestRule | None = None,
          vms: Sequence[str] = ()) -> list[dict[str, Any]]:
    """`records`: (vm, backend, type name, type id, gpu address) of the live vGPUs here; `boot_modes`: recorded
    vGPU mode per GPU. Calls `say(severity, area, message)`; returns the per-GPU summary for the report."""
    target = driver or running
    branch = sm.branch_of(target)
    out = []
    if target and kernel:
        for row in sm.kernel_breakages(kernel, target):
            say("block", "kernel", f"NVIDIA driver {target} ({sm.release_name(branch)}) on kernel {kernel}: "
                                   f"{row['what']} ({row['source']}); every vGPU here would be lost")
    for g in gpus(cfg) if branch else []:
        mine = [r for r in records if r[4] == g.address]
        sup = sm.support(g.device_id, branch)
        card = f"{g.address} {g.name} (10de:{g.device_id})"
        out.append({"gpu": g.address, "name": g.name, "device": g.device_id, "branch": branch,
                    "support": sup.answer, "vgpus": len(mine)})
        if sup.answer == sm.NO:
            kept = ", ".join(sm.release_name(b) for b in sm.supported_branches(g.device_id)) or "none listed"
            say("block" if mine else "warn", "gpu", f"{card}: {sup.words(g.name, branch)}: it would offer no vGPU "
                f"type ({len(mine)} recorded vGPU(s) here); branches that support it: {kept} ({sup.source})")
        elif sup.answer == sm.UNKNOWN and driver:
            say("info", "gpu", f"{card}: {sup.words(g.name, branch)}")
        mode = boot_modes.get(g.address) or mixed.mode_of(g.nvml)
        mixed_from = sm.feature("mixed-size")["from_branch"]
        if mode == "mixed" and sm.branch_number(branch) < sm.branch_number(mixed_from):
            say("block" if mine else "warn", "gpu", f"{card}: mixed-size mode exists from {sm.release_name(mixed_from)}"
                f" on; {sm.release_name(branch)} would lose it")
        mig_backed = [r for r in mine if (ids.parse_type_name(r[2] or "") or _NOT).mig_backed]
        nvaie_from = sm.feature("mig-backed")["nvaie_from_branch"]
        if mig_backed and sup.mig and sm.branch_number(branch) >= sm.branch_number(nvaie_from):
            say("warn", "gpu", f"{card}: {len(mig_backed)} MIG-backed vGPU(s): from {sm.release_name(nvaie_from)} on "
                               "MIG GPUs are supported only under NVIDIA AI Enterprise (its host package and "
                               "licence)")
    if guests is not None and target:
        for vm in vms:
            for finding in guests(vm, target):
                say(*finding)
    return out


class _Unparsed:
    mig_backed = False


_NOT = _Unparsed()
