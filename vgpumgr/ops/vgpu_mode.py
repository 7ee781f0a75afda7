"""`vgpumgr gpu mode BDF --mixed|--equal`: NVIDIA's vGPU mode of one physical GPU, set through NVML.

Refused, with the reason, while a vGPU (an mdev, or a VF with a type) exists on the GPU, while MIG is on, and
when NVML says the GPU lacks HETEROGENEOUS_TIMESLICE_SIZES (on KVM it appears only once the VFs are enabled).
The mode is audited and recorded (gpu_boot_state.vgpu_mode) so that `restore` sets it again after a reboot.
"""

from __future__ import annotations

from typing import Any

from vgpumgr import ids
from vgpumgr.errors import Conflict, NotFound, Unavailable, VgpuError
from vgpumgr.nvidia import mixed as nvml_mixed
from vgpumgr.ops import boot_records
from vgpumgr.ops.context import Context

MIXED, EQUAL = "mixed", "equal"
AUDIT_ACTION = "gpu.mode"


def facts(layer: Any, gpu: str) -> dict[str, Any]:
    """NVML's mixed-size facts and MIG state of one GPU ({} when NVML does not know it)."""
    g = layer.gpus().get(gpu) or {}
    return {"mixed_size": nvml_mixed.facts_of(g),
            "mig": (g.get("mig") or {}).get("current") == "enabled", "known": bool(g)}


def refusal(svc: Context, layer: Any, gpu: str, mode: str) -> VgpuError | None:
    f = facts(layer, gpu)
    if not f["known"]:
        return NotFound(f"NVML does not know GPU {gpu}", hint="`vgpumgr gpus` lists the GPUs; is NVML loaded?")
    if f["mig"]:
        return Conflict(f"MIG is on for {gpu}: the vGPU mode applies to time-sliced vGPUs only",
                        hint=f"`vgpumgr mig mode {gpu} off` first")
    capable = f["mixed_size"].get("capable")
    if capable is None:
        return Unavailable(f"NVML cannot tell whether {gpu} supports mixed-size mode",
                           hint="needs the NVIDIA vGPU host driver 17 (R550) or newer and nvidia-ml-py 12.550+")
    if not capable and mode == MIXED:
        return Conflict(f"{gpu} lacks NVML's HETEROGENEOUS_TIMESLICE_SIZES capability: no mixed-size mode",
                        hint="on KVM it appears once the GPU's VFs are enabled (sriov-manage -e); "
                             "GPUs without SR-IOV never have it")
    inv = svc.snapshot(refresh=True).inventory
    held = [m.uuid for m in inv.mdevs if m.gpu == gpu] + [v.address for v in inv.vf_vgpus if v.gpu == gpu]
    if held:
        return Conflict(f"{gpu} holds {len(held)} vGPU(s) ({', '.join(held[:4])}{', …' if len(held) > 4 else ''}): "
                        "the driver changes the mode only with none",
                        hint="release its vGPUs first (`vgpumgr placements`)")
    return None


def set_mode(svc: Context, gpu: str, mode: str, *, actor: str | None = None) -> dict[str, Any]:
    gpu = ids.pci_address(gpu)
    if mode not in (MIXED, EQUAL):
        raise ValueError(mode)
    if svc.snapshot().inventory.gpu(gpu) is None:
        raise NotFound(f"no GPU {gpu}", hint="`vgpumgr gpus` lists the GPUs")
    try:
        layer = svc.nvml()
    except VgpuError as e:
        raise Unavailable(f"NVML is not available, so the vGPU mode of {gpu} cannot be set", hint=e.hint) from e
    with svc.locked():
        before = facts(layer, gpu)["mixed_size"].get("mode")
        err = refusal(svc, layer, gpu, mode)
        if err is None and before != mode:
            try:
                after = layer.set_vgpu_mode(gpu, mode == MIXED)
            except VgpuError as e:
                err = e
            else:
                if after != mode:
                    err = Conflict(f"{gpu} reads back {after} after setting {mode} mode",
                                   hint="check `nvidia-smi -q` (vGPU Heterogeneous Mode) and `dmesg`")
        if err is not None:
            svc.record_failure(AUDIT_ACTION, err, actor=actor, gpu=gpu, detail={"mode": mode, "before": before})
            raise err
        with svc.tx() as s:
            boot_records.remember_vgpu_mode(s, svc.host_id(s), gpu, mode)
            svc.event(s, AUDIT_ACTION, actor=actor, gpu=gpu, detail={"mode": mode, "before": before,
                                                                     "changed": before != mode})
        svc.invalidate()
    return {"gpu": gpu, "mode": mode, "before": before, "changed": before != mode}


def drift(svc: Context, inventory: Any) -> list[dict[str, Any]]:
    """GPUs whose vGPU mode, as `gpu mode` recorded it, is not what the driver holds now (a reboot, a driver reload
    or `sriov-manage` took it away; `restore` sets it again). A GPU whose mode NVML cannot tell is not judged."""
    with svc.reads() as s:
        recorded = {gpu: st.vgpu_mode for gpu, st in boot_records.boot_states(s, svc.host_id(s)).items()
                    if st.vgpu_mode}
    out = []
    for g in inventory.gpus:
        want = recorded.get(g.address)
        have = nvml_mixed.mode_of(g.nvml) if want else None
        if want and have and have != want:
            out.append({"gpu": g.address, "recorded": want, "actual": have,
                        "why": "the driver forgets it at a reboot, a driver reload and sriov-manage; `vgpumgr restore` "
                               "sets it again while no vGPU exists on the GPU"})
    return out
