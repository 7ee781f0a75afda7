"""`vgpumgr vendor prepare`: a card's mode steps run by hand, audited and recorded for `vgpumgr restore`, as the
other manual device changes (ops/manual.py): the kernel (or the vendor's tool) first, then the records."""

from __future__ import annotations

from typing import Any

from vgpumgr import ids
from vgpumgr.config import Config
from vgpumgr.discovery.fs import read_int
from vgpumgr.errors import InvalidInput, VgpuError
from vgpumgr.ops.manual import _boot_record, audited
from vgpumgr.vendors import profiles as vendors
from vgpumgr.vendors import steps as vendor_steps


def prepare(cfg: Config, address: str, *, vfs: int | None = None, vf_memory_mib: int | None = None,
            dry_run: bool = False) -> list[dict[str, Any]]:
    host = cfg.host
    pf = ids.pci_address(address)
    card = vendor_steps.card(host, pf)
    if vfs is not None and not 0 <= vfs <= 1024:
        raise InvalidInput(f"--vfs {vfs} is out of range", hint="give a VF count such as 4 or 8")
    least = vendors.MIN_VF_MEMORY_MIB
    if vf_memory_mib is not None and vf_memory_mib < least:
        raise InvalidInput(f"--vf-memory {vf_memory_mib} MiB is below the {least} MiB a VF needs at least",
                           hint=f"give MiB per VF, at least {least} (Intel's profiles: 704 to 16000, "
                                "such as 2000 for 8 VFs of a Flex 170)")
    if card.mechanism == vendors.PASSTHROUGH:
        raise InvalidInput(f"{card.name} at {pf} gives VMs whole devices only: there is nothing to prepare",
                           hint=f"pass it through: `vgpumgr vm create NAME --passthrough {pf}`")
    if card.mechanism == vendors.MDEV and (vfs is not None or vf_memory_mib is not None):
        raise InvalidInput(f"{card.name} slices are mdev types; its VFs are the driver's own",
                           hint="leave out --vfs and --vf-memory")
    if vf_memory_mib is not None and card.family not in ("intel-i915", "intel-xe"):
        raise InvalidInput(f"{card.name} has no per-VF memory quota vgpumgr can write", hint="leave out --vf-memory")
    if vf_memory_mib is not None and not vfs:
        raise InvalidInput("--vf-memory needs --vfs N", hint="say how many VFs get that quota")
    results: list[vendor_steps.StepResult] = []
    if vendors.STEP_ASCEND_VM_MODE in card.steps:
        step = vendor_steps.read_step(host, pf, vendors.STEP_ASCEND_VM_MODE, {"mode": 1}) if dry_run else \
            vendor_steps.set_ascend_mode(host, pf, 1)
        results.append(step)
    elif card.mechanism == vendors.MDEV:
        results.append(vendor_steps.StepResult("none", pf, True, "no mode step: its mdev types are ready"))
    if card.mechanism == vendors.MODULE_VFS:
        want = vfs if vfs is not None else vendor_steps.gim_state(host, pf)["numvfs"]
        results.append(vendor_steps.check_gim(host, pf, want))
    elif card.mechanism == vendors.SRIOV and vfs is not None:
        results += _sriov(cfg, pf, card, vfs, vf_memory_mib, dry_run)
    out = [r.as_dict() for r in results]
    if not dry_run and all(r.ok for r in results):
        state = vendor_steps.observed(host, pf)
        audited(cfg, "vendor.prepare", gpu=pf, detail={"steps": out, "state": state})
        _boot_record(cfg, "remember_vendor", pf, vendor_steps.to_record(state))
        if card.mechanism != vendors.MDEV:
            gim = state.get(vendors.STEP_GIM_VF_NUM) or {}  # GIM's count as `observed` just read it
            numvfs = gim["vf_num"] if "vf_num" in gim else read_int(f"{host.pci(pf)}/sriov_numvfs", 0) or 0
            _boot_record(cfg, "remember_numvfs", pf, numvfs)
    return out


def _sriov(cfg: Config, pf: str, card: vendors.Profile, vfs: int, vf_memory_mib: int | None,
           dry_run: bool) -> list[vendor_steps.StepResult]:
    from vgpumgr.backends import sriov

    host = cfg.host
    out = []
    before = None
    if vf_memory_mib is not None:
        want = {str(n): vf_memory_mib << 20 for n in range(1, vfs + 1)}
        if dry_run:
            out.append(vendor_steps.read_step(host, pf, card.steps[0], {"quotas": want}))
        else:
            before = vendor_steps.all_quotas(host, pf, card)
            res = vendor_steps.set_quotas(host, pf, card, want)
            out.append(res)
            if not res.ok:
                return out
    if dry_run:
        return out
    try:
        made = sriov.set_numvfs(host, pf, vfs)
    except VgpuError as e:  # the quotas just written go back: nothing half-made, nothing recorded
        if before is not None:
            vendor_steps.put_back_quotas(host, pf, card, before, e)
        raise
    out.append(vendor_steps.StepResult("vfs", pf, True, f"{len(made)} VFs enabled", len(made)))
    return out


def cards(host: Any) -> list[dict[str, Any]]:
    """The host's cards with a vendor profile (`vgpumgr vendor list`): mechanism, driver, VFs, mode-step state."""
    from vgpumgr.discovery.pci import discover_gpus

    out = []
    for g in discover_gpus(host):
        p = vendors.profile(g.vendor_id, g.device_id)
        if p is None or g.is_vf:
            continue
        out.append({"address": g.address, "name": p.name, "mechanism": p.mechanism, "driver": g.driver,
                    "vfs": f"{g.sriov.numvfs}/{g.sriov.totalvfs}" if g.sriov else None,
                    "state": vendor_steps.observed(host, g.address), "note": p.note,
                    "unconfirmed": list(p.unconfirmed)})
    return out


def cards_of(svc: Any) -> list[dict[str, Any]]:
    """`cards` of the service's host (GET /v1/vendors)."""
    return cards(svc.host)
