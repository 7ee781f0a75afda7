"""The restore steps of NVIDIA mixed-size mode (called by vgpumgr.ops.restore_steps.GpuRun):

- `vgpu_mode`: after the VFs are enabled and before any vGPU type is set, the GPU's recorded mode (the driver
  forgets it at every reboot, driver reload and sriov-manage), read back afterwards;
- `placement`: right after each vGPU is made again, the placement ID its record holds, read back. Made one by
  one, each vGPU's recorded ID is free when it comes (the recorded layout never overlaps), so the order of
  creation does not matter.
"""

from __future__ import annotations

from typing import Any

from vgpumgr.backends import placement_id as pid_backend
from vgpumgr.errors import VgpuError
from vgpumgr.ops import vgpu_mode as modes

OK_, DONE, FAILED_ = "ok", "done", "failed"  # restore_steps' statuses (it imports this module)


def _layer(run: Any) -> Any:
    if run.layer is None:
        run.layer = run.svc.nvml()
    return run.layer


def vgpu_mode(run: Any) -> None:
    gpu, want = run.w.gpu, run.w.vgpu_mode
    try:
        layer = _layer(run)
        now = modes.facts(layer, gpu)["mixed_size"].get("mode")
    except VgpuError as e:
        run.step("vgpu-mode", gpu, FAILED_, f"cannot read the vGPU mode: {e.message}", hint=e.hint)
        return
    if now == want:
        run.step("vgpu-mode", gpu, OK_, f"{want}-size vGPU mode is set", mode=want)
        return
    if not run.change("vgpu-mode", gpu, f"set {want}-size vGPU mode on {gpu} (records)",
                      lambda: layer.set_vgpu_mode(gpu, want == modes.MIXED), mode=want):
        return
    if run.dry_run:
        return
    after = modes.facts(layer, gpu)["mixed_size"].get("mode")
    if after != want:
        run.steps[-1]["status"] = FAILED_
        run.step("vgpu-mode", gpu, FAILED_, f"{want}-size mode did not stick: NVML reads {after or 'unknown'}",
                 hint="set it before any vGPU type and after sriov-manage -e; check `nvidia-smi -q`")
    else:
        run.steps[-1]["status"] = DONE


def placement(run: Any, target: str, want: int | None, *, uuid: str | None = None, vf: str | None = None) -> None:
    """Give the vGPU `target` (mdev UUID or VF) its recorded placement ID `want` again, and read it back. One whose
    recorded ID the driver chose (equal-size mode) is not asked for: its record takes what the driver gives now."""
    if want is None:
        row = run.w.observed.get(target)
        if row is not None and not run.dry_run:
            from vgpumgr.ops import placement_apply

            got = pid_backend.current(pid_backend.device_dir(run.host, uuid=uuid, vf=vf))
            if got is not None:  # the driver says: its record follows (a read that says nothing keeps the record)
                placement_apply.record(run.svc, row, got, "placement_id", by_driver=True)
        return
    d = pid_backend.device_dir(run.host, uuid=uuid, vf=vf)
    if run.dry_run:
        run.step("placement", target, "planned", f"would give {target} placement ID {want}", placement_id=want)
        return
    if pid_backend.current(d) == want:
        run.step("placement", target, OK_, f"{target} holds placement ID {want}", placement_id=want)
        return
    if not run.change("placement", target, f"give {target} placement ID {want} (records)",
                      lambda: pid_backend.apply(run.host, d, want), placement_id=want):
        return
    got = pid_backend.current(d)
    if got != want:
        run.step("placement", target, FAILED_, f"placement ID {want} did not stick: the driver holds {got}",
                 hint="another vGPU may hold it; `vgpumgr gpu slots` shows the map")
