"""The vendor steps of `vgpumgr restore` on one card (vendors/steps.py), reported as restore's other steps:
Ascend's vNPU VM mode set again, Intel's per-VF quotas written again before the VFs, AMD GIM's VF count checked
(blocked with the module reload that would change it)."""

from __future__ import annotations

from typing import Any

from vgpumgr.errors import VgpuError
from vgpumgr.vendors import profiles as vendors
from vgpumgr.vendors import steps as vendor_steps

# restore's step statuses (restore_steps.py names them; repeated here so that the two modules need not import
# each other)
OK_, DONE, PLANNED, BLOCKED, FAILED_ = "ok", "done", "planned", "blocked", "failed"

ORDER = (vendors.STEP_ASCEND_VM_MODE, vendors.STEP_GIM_VF_NUM, vendors.STEP_I915_LMEM_QUOTA,
         vendors.STEP_XE_VRAM_QUOTA)


def wanted(vendor_state: dict[str, Any], numvfs: int | None, fixed_vfs: bool) -> dict[str, Any]:
    """The steps one card must hold, in order: its recorded vendor steps, and on a card whose driver fixes the VF
    count at load (GIM) the PF's recorded VF count (or the boot profile's) as the `gim-vf-num` step."""
    want = dict(vendor_state)
    if numvfs and fixed_vfs:
        want[vendors.STEP_GIM_VF_NUM] = {"vf_num": numvfs}  # the recorded VF count is what GIM must have made
    return {k: want[k] for k in sorted(want, key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER))}


def run_vendor_steps(run: Any) -> None:  # run: restore_steps.GpuRun
    """Each recorded step checked and brought back; one that failed or is blocked is named in `run.vendor_waits`,
    and the card's VFs and mdevs then wait for it (skipped): VFs enabled without Intel's quotas get the driver's
    own, which no later restore can change while they exist. The card is the one `run` read (once per GPU)."""
    pf = run.w.gpu
    want = wanted(run.w.vendor, run.w.numvfs, run.fixed_vfs)
    for step, value in want.items():
        try:
            now = vendor_steps.read_step(run.host, pf, step, value, run.card)
        except VgpuError as e:
            run.step(step, pf, FAILED_, e.message, hint=e.hint)
            run.vendor_waits.append(step)
            continue
        if now.ok:
            run.step(step, pf, OK_, now.message)
            continue
        if step == vendors.STEP_GIM_VF_NUM:  # never written by vgpumgr
            run.step(step, pf, BLOCKED, now.message, hint=now.hint, numvfs=now.current.get("numvfs"))
            run.vendor_waits.append(step)
            continue
        if run.dry_run:
            run.step(step, pf, PLANNED, f"would bring back {step}: {vendor_steps.step_text(value)} ({now.message})")
            continue
        try:
            res = vendor_steps.apply(run.host, pf, step, value, run.card)
        except VgpuError as e:
            run.step(step, pf, FAILED_, f"{step}: {e.message}", hint=e.hint)
            run.vendor_waits.append(step)
            continue
        run.step(step, pf, DONE if res.ok else BLOCKED, res.message, hint=res.hint)
        if not res.ok:
            run.vendor_waits.append(step)


def ensure_vnpu_mode(svc: Any, parent: str | None, type_id: str | None, actor: str | None = None) -> None:
    """Before an Ascend vNPU mdev is made again (a hook's prepare, a VM's start after a reboot): the card's VM
    mode, which the reboot took, set again and audited. Other types and parents pass untouched."""
    from vgpumgr import ids

    if not (type_id and type_id.startswith("vnpu-") and parent and ids.is_pci_address(parent)):
        return
    pf = ids.pci_address(parent)
    if vendor_steps.ascend_mode(svc.host, pf) == 1:
        return
    res = vendor_steps.set_ascend_mode(svc.host, pf, 1)
    svc.invalidate()
    with svc.tx() as s:
        svc.event(s, f"vendor.{vendors.STEP_ASCEND_VM_MODE}", actor=actor, gpu=pf, detail={"message": res.message})


def drift(svc: Any, inventory: Any) -> list[dict[str, Any]]:
    """Cards whose recorded vendor steps (Ascend's VM mode, Intel's per-VF quotas, GIM's VF count as the PF's
    recorded VF count) the card no longer holds: a reboot or a module reload took them; `vgpumgr restore` writes
    them again. Read only; a card that cannot be read is reported with why."""
    from vgpumgr.ops import boot_records

    with svc.reads() as s:
        states = boot_records.boot_states(s, svc.host_id(s))
    fixed = {g.address for g in inventory.gpus if not g.is_vf
             and (p := vendors.profile(g.vendor_id, g.device_id)) is not None and p.mechanism == vendors.MODULE_VFS}
    out = []
    for pf, st in sorted(states.items()):
        steps = wanted(dict(st.vendor_state or {}), st.numvfs, pf in fixed)
        for step in steps:
            try:
                now = vendor_steps.read_step(svc.host, pf, step, steps[step])
            except VgpuError as e:
                out.append({"gpu": pf, "step": step, "recorded": vendor_steps.step_text(steps[step]), "actual": None,
                            "why": e.message})
                continue
            if not now.ok:
                out.append({"gpu": pf, "step": step, "recorded": vendor_steps.step_text(steps[step]),
                            "actual": now.message,
                            "why": "a reboot or a module reload takes it; `vgpumgr restore` writes it again"})
    return out
