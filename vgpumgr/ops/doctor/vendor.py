"""Section "vendor steps": other vendors' mode steps as recorded (Ascend vNPU VM mode, AMD GIM vf_num, Intel
per-VF quotas) against what the cards show now (vgpumgr/vendors/steps.py)."""

from __future__ import annotations

from vgpumgr.ops.doctor.facts import Facts
from vgpumgr.ops.doctor.report import Section

TITLE = "vendor steps"


def recorded_steps(s: Section, f: Facts) -> None:
    from vgpumgr.errors import VgpuError
    from vgpumgr.vendors import steps as vendor_steps

    checked = {g.address for g in f.physical}
    for address, rec in sorted((f.records or {}).items()):
        if address not in checked:
            continue
        for step, value in sorted((rec.get("vendor_state") or {}).items()):
            check = f"{step} as recorded"
            try:
                r = vendor_steps.read_step(f.host, address, step, value)
            except VgpuError as e:
                s.warn(f"vendor.{step}", check, e.message, hint=e.hint or "`vgpumgr vendor prepare`", gpu=address)
                continue
            if r.ok:
                s.pass_(f"vendor.{step}", check, r.message, gpu=address)
            else:
                s.fail(f"vendor.{step}", check, f"{r.message}; the record wants {value}", gpu=address,
                       hint=r.hint or "`vgpumgr restore` brings it back")


def ascend_mode(s: Section, f: Facts) -> None:
    from vgpumgr.vendors import profiles as vendors
    from vgpumgr.vendors import steps as vendor_steps

    for g in f.physical:
        p = vendors.profile(g.vendor_id, g.device_id)
        if p is None or vendors.STEP_ASCEND_VM_MODE not in p.steps:
            continue
        if vendors.STEP_ASCEND_VM_MODE in (((f.records or {}).get(g.address) or {}).get("vendor_state") or {}):
            continue  # recorded_steps compares it
        try:
            mode = vendor_steps.ascend_mode(f.host, g.address)
        except Exception:  # noqa: BLE001 - no npu-smi: nothing to say beyond the driver check
            continue
        if mode == 1:
            s.pass_("vendor.ascend", "vNPU VM mode", "VM mode (1)", gpu=g.address)
        else:
            s.note("vendor.ascend", "vNPU VM mode", f"container mode ({mode}): no vNPU type can be made for VMs",
                   gpu=g.address, hint=f"`vgpumgr vendor prepare {g.address}` (npu-smi set -t vnpu-mode -d 1)")


CHECKS = (recorded_steps, ascend_mode)
