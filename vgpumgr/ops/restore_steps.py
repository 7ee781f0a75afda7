"""The steps of `vgpumgr restore` on one GPU, in the driver's order: VFs, MIG mode, GPU instances, VF vGPU
types, mdevs. Each step is reported (and, when it changes something, audited) with one of the statuses:

ok       already in place            done     changed now            planned  would change (dry run)
unknown  not recorded, left alone    blocked  in the way (--force)   pending  MIG needs a GPU reset
failed   the kernel or NVML refused  skipped  waits for an earlier step
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgpumgr import ids
from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.backends import nvidia_vf, sriov
from vgpumgr.backends.common import wait_for
from vgpumgr.discovery.fs import read, read_int
from vgpumgr.errors import InvalidInput, NoCapacity, VgpuError
from vgpumgr.ops import boot_records, restore_mixed
from vgpumgr.ops.context import FAILED, OK, WARNING, Context

OK_, DONE, PLANNED, UNKNOWN, BLOCKED, PENDING, FAILED_, SKIPPED = (
    "ok", "done", "planned", "unknown", "blocked", "pending", "failed", "skipped")
SRIOV_MANAGE = "/usr/lib/nvidia/sriov-manage"


@dataclass
class Want:
    """What one GPU (or virtual mdev parent) should have."""

    gpu: str
    numvfs: int | None = None
    numvfs_source: str = "records"
    mig: bool = False
    gis: list[boot_records.RecordedGi] = field(default_factory=list)
    vf_types: dict[str, tuple[str, str]] = field(default_factory=dict)  # VF -> (type, "records"|"profile")
    mdevs: list[dict[str, Any]] = field(default_factory=list)  # allocation dicts
    owned_vfs: list[str] = field(default_factory=list)  # VFs whose type another manager (Proxmox) writes
    vgpu_mode: str | None = None  # NVIDIA mixed/equal-size mode as `vgpumgr gpu mode` recorded it
    placements: dict[str, int] = field(default_factory=dict)  # VF or mdev UUID -> recorded placement ID
    observed: dict[str, int] = field(default_factory=dict)  # VF or mdev UUID -> allocation id: driver-given ID
    vendor: dict[str, Any] = field(default_factory=dict)  # vendor mode steps (vendors/steps.py), by step
    scheduler: dict[str, Any] | None = None  # the recorded vGPU scheduler (vgpumgr.ops.scheduler.intents)



class GpuRun:
    def __init__(self, svc: Context, layer: Any | None, want: Want, *, dry_run: bool, force: bool,
                 actor: str | None) -> None:
        self.svc, self.host, self.layer, self.w = svc, svc.host, layer, want
        self.dry_run, self.force, self.actor = dry_run, force, actor
        self.steps: list[dict[str, Any]] = []
        self.vfs_planned = False
        self.mig_ready = True
        self.mig_on_now = False
        self.vendor_waits: list[str] = []  # vendor steps that failed or are blocked: the VFs and mdevs wait
        self.unknown: list[str] = []

    @functools.cached_property
    def card(self) -> Any:
        """The GPU's vendor profile (None: not a vendor card), read once per restore."""
        from vgpumgr.vendors.steps import card_or_none

        return card_or_none(self.host, self.w.gpu)

    @property
    def fixed_vfs(self) -> bool:
        """Its driver fixes the VF count at load (AMD GIM): checked by a vendor step, never written."""
        from vgpumgr.vendors.profiles import MODULE_VFS

        return self.card is not None and self.card.mechanism == MODULE_VFS

    def step(self, kind: str, target: str, status: str, message: str, hint: str | None = None,
             **detail: Any) -> None:
        st = {"step": kind, "target": target, "status": status, "message": message, **detail}
        if hint:
            st["hint"] = hint
        self.steps.append(st)
        if self.dry_run or status in (OK_, UNKNOWN, SKIPPED, PLANNED):
            return
        outcome = OK if status == DONE else FAILED if status == FAILED_ else WARNING
        with self.svc.tx() as s:
            self.svc.event(s, f"restore.{kind}", outcome, actor=self.actor, gpu=self.w.gpu,
                           vgpu=target if target != self.w.gpu else None, error=message if outcome != OK else None,
                           detail={k: v for k, v in st.items() if k not in ("step", "status")} | {"status": status})

    def change(self, kind: str, target: str, message: str, do: Callable[[], Any], **detail: Any) -> bool:
        """Run one change (or plan it); a failure becomes a failed step. True when it is (or would be) done."""
        if self.dry_run:
            self.step(kind, target, PLANNED, "would " + message, **detail)
            return True
        try:
            do()
        except VgpuError as e:
            if isinstance(e, NoCapacity) and self.unknown:
                self.step(kind, target, BLOCKED, f"{message}: {e.message}; devices nobody recorded take the room: "
                          f"{', '.join(self.unknown)}", hint="`vgpumgr restore --force` removes them first", **detail)
            else:
                self.step(kind, target, FAILED_, f"{message}: {e.message}", hint=e.hint, **detail)
            return False
        self.step(kind, target, DONE, message, **detail)
        return True

    def all(self) -> None:
        if self.w.vendor or (self.w.numvfs and self.fixed_vfs):
            from vgpumgr.ops.restore_vendor import run_vendor_steps

            run_vendor_steps(self)  # before the VFs: Ascend's mode, Intel's quotas; AMD's VF count is checked there
        if self.w.numvfs:
            self.vfs()
        if self.w.mig:
            self.mig_mode()
            if self.w.gis:
                self.gpu_instances()
        if self.w.vgpu_mode:  # after the VFs, before any vGPU type (vgpumgr.ops.restore_mixed)
            restore_mixed.vgpu_mode(self)
        if self.w.scheduler:  # after the mode (fixed share needs equal size), before the VF types
            self.scheduler()
        self.vf_types()
        self.mdevs()

    # -- the vGPU scheduler (before the first vGPU: NVML refuses a change while one exists) -----------
    def scheduler(self) -> None:
        from vgpumgr.ops import scheduler as scheduler_ops

        gpu, intent = self.w.gpu, self.w.scheduler or {}
        plan = scheduler_ops.restore_plan(self.layer, gpu, intent)
        status = {"ok": OK_, "pending": PENDING, "failed": FAILED_}.get(plan["action"])
        if status:
            self.step("scheduler", gpu, status, plan["message"], hint=plan.get("hint"), policy=intent.get("policy"))
        elif self.change("scheduler", gpu, plan["message"], plan["apply"], policy=intent.get("policy")) \
                and not self.dry_run:
            scheduler_ops.mark_applied(self.svc.cfg, gpu)

    # -- 1. VFs ------------------------------------------------------------------------------------
    def vfs(self) -> None:
        pf, want = self.w.gpu, self.w.numvfs or 0
        if self.fixed_vfs:
            return  # GIM makes its VFs at load: checked by the vendor step, never written
        if self.vendor_waits:  # e.g. Intel's quotas: VFs enabled without them get the driver's, fixed from then on
            self.step("vfs", pf, SKIPPED, f"{want} VFs: waits for an earlier step: {', '.join(self.vendor_waits)}",
                      numvfs=want)
            return
        cur = read_int(f"{self.host.pci(pf)}/sriov_numvfs")
        if cur is None:
            self.step("vfs", pf, FAILED_, f"{pf} is gone or has no SR-IOV", hint="check `vgpumgr gpus` and `dmesg`")
            return
        if cur >= want:
            note = "" if cur == want else f" ({want} wanted by the {self.w.numvfs_source}; left as they are)"
            self.step("vfs", pf, OK_, f"{cur} VFs enabled{note}", numvfs=cur)
            return
        if cur:
            if not self.force:
                self.step("vfs", pf, BLOCKED, f"{pf} has {cur} VFs, {want} are recorded",
                          hint="changing the count disables its VFs first: add --force (VFs in use are refused)")
                return
        self.vfs_planned = self.change("vfs", pf, f"enable {want} VFs on {pf} (from {self.w.numvfs_source})",
                                       lambda: self._enable_vfs(pf, want, cur), numvfs=want)

    def _enable_vfs(self, pf: str, want: int, cur: int) -> None:
        nvidia = (read(f"{self.host.pci(pf)}/vendor") or "").lower() == "0x10de"
        tool = os.environ.get("VGPUMGR_SRIOV_MANAGE", SRIOV_MANAGE)
        if nvidia and not cur and not self.host.simulated and Path(tool).is_file():
            # NVIDIA's own script (it enables every VF the PF offers); vgpumgr writes sriov_numvfs only without it
            try:
                done = subprocess.run([tool, "-e", pf], capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise VgpuError(f"{tool} -e {pf} did not run: {e}", hint="run it by hand and check `dmesg`") from e
            if done.returncode != 0:
                raise VgpuError(f"{tool} -e {pf} failed: {(done.stderr or done.stdout).strip()[-300:]}",
                                hint="check `dmesg` and that the NVIDIA vGPU host driver is loaded")
            if (read_int(f"{self.host.pci(pf)}/sriov_numvfs", 0) or 0) >= want:
                return
        sriov.set_numvfs(self.host, pf, want, allow_nvidia=True)

    # -- 2. MIG mode -------------------------------------------------------------------------------
    def mig_mode(self) -> None:
        gpu = self.w.gpu
        if self.layer is None:
            self.mig_ready = False
            self.step("mig-mode", gpu, FAILED_, "NVML is not available, so MIG cannot be restored",
                      hint="install the NVIDIA driver's NVML and nvidia-ml-py")
            return
        m = (self.layer.gpu(gpu).get("mig") or {})
        if m.get("current") == "enabled":
            self.mig_on_now = True
            self.step("mig-mode", gpu, OK_, "MIG mode is on")
            return
        self.mig_ready = False
        if m.get("pending") == "enabled":
            self.step("mig-mode", gpu, PENDING, "MIG mode is on only after a GPU reset",
                      hint="stop every process on the GPU, reset it (nvidia-smi -r -i ...), then run restore again")
            return
        if self.dry_run:
            self.step("mig-mode", gpu, PLANNED, "would turn MIG mode on")
            self.mig_ready = True
            return
        try:
            res = self.layer.set_mig_mode(gpu, True)
            self.host.kernel.gpu_instances_changed(self.layer)
        except VgpuError as e:
            self.step("mig-mode", gpu, FAILED_, f"turning MIG mode on: {e.message}", hint=e.hint)
            return
        if res["current"] == "enabled":
            self.mig_ready = self.mig_on_now = True
            self.step("mig-mode", gpu, DONE, "MIG mode turned on")
        else:
            self.step("mig-mode", gpu, PENDING, "MIG mode turned on; it takes effect after a GPU reset",
                      hint="vgpumgr never resets a GPU: stop its processes, reset it (nvidia-smi -r), "
                           "then run restore again")

    # -- 3. GPU instances --------------------------------------------------------------------------
    def gpu_instances(self) -> None:
        gpu = self.w.gpu
        if not self.mig_ready:
            for gi in self.w.gis:
                self.step("gpu-instance", f"{gpu}@{gi.start}", SKIPPED, f"{gi.profile} at slice {gi.start}: "
                          "waits for MIG mode")
            return
        existing = self.layer.gpu_instances(gpu) if self.mig_on_now else []
        table = self.layer.mig_table(gpu)
        changed = False
        for gi in self.w.gis:
            target = f"{gpu}@{gi.start}"
            prof = table.find(gi.profile)
            span = range(gi.start, gi.start + prof.size)
            same = [p for p in existing if p.start == gi.start and p.profile_id == prof.id]
            if same:
                self.step("gpu-instance", target, OK_, f"{prof.name} at slice {gi.start} exists (GI {same[0].id})")
                continue
            others = [p for p in existing if set(p.slices) & set(span)]
            if others and not self.force:
                names = ", ".join(f"GI {p.id} at {p.start}+{p.size}" for p in others)
                self.step("gpu-instance", target, BLOCKED, f"{prof.name} at slice {gi.start}: {names} in the way",
                          hint="add --force to destroy GPU instances vgpumgr did not record there")
                continue
            for p in others:
                changed |= self.change("remove", f"{gpu}/gi{p.id}", f"destroy GI {p.id} at slice {p.start}",
                                       lambda p=p: self.layer.destroy_gpu_instance(gpu, p.id))
                existing.remove(p)
            ok = self.change("gpu-instance", target, f"create {prof.name} at slice {gi.start}",
                             lambda gi=gi, prof=prof: self.layer.create_gpu_instance(
                                 gpu, prof.id, start=gi.start, compute_instance=gi.compute_instance),
                             profile=prof.name, start=gi.start, size=prof.size)
            changed |= ok and not self.dry_run
        if changed:
            self.host.kernel.gpu_instances_changed(self.layer)
        self.svc.invalidate()

    # -- 4. VF vGPU types --------------------------------------------------------------------------
    def _vfs_on_gpu(self) -> list[str]:
        if not ids.is_pci_address(self.w.gpu):  # a virtual mdev parent (mtty)
            return []
        return sriov.vfs(self.host, self.w.gpu) if (self.host.pci(self.w.gpu) / "sriov_numvfs").exists() else []

    def vf_types(self) -> None:
        wanted = self.w.vf_types
        present = self._vfs_on_gpu()
        for vf in present:  # vGPUs nobody recorded, on a GPU we restore
            if vf in wanted or not (self.host.pci(vf) / "nvidia/current_vgpu_type").exists():
                continue
            cur = nvidia_vf.current(self.host, vf)
            if cur:
                self._in_the_way(vf, f"VF {vf} holds nvidia-{cur}, which vgpumgr did not record",
                                 lambda vf=vf: nvidia_vf.clear_type(self.host, vf, retries=1))
        for vf, (vtype, source) in sorted(wanted.items()):
            if not self._wait_vf(vf):
                status = PLANNED if self.dry_run and self.vfs_planned else FAILED_
                self.step("vf-type", vf, status, f"{'would set' if status == PLANNED else 'cannot set'} {vtype}: "
                          f"VF {vf} {'appears once the VFs are enabled' if status == PLANNED else 'does not exist'}",
                          hint=None if status == PLANNED else "enable the PF's VFs first (see the vfs step)")
                continue
            try:
                tid = self._type_id(vf, vtype)
            except VgpuError as e:
                self.step("vf-type", vf, FAILED_, e.message, hint=e.hint)
                continue
            cur = nvidia_vf.current(self.host, vf)
            if cur == tid:
                self.step("vf-type", vf, OK_, f"VF {vf} holds nvidia-{tid}", type=f"nvidia-{tid}", source=source)
                restore_mixed.placement(self, vf, self.w.placements.get(vf), vf=vf)
                continue
            if cur and not self._in_the_way(vf, f"VF {vf} holds nvidia-{cur}, not nvidia-{tid} ({source})",
                                            lambda vf=vf: nvidia_vf.clear_type(self.host, vf, retries=1)):
                continue
            if self.change("vf-type", vf, f"set nvidia-{tid} on VF {vf} ({source})",
                           lambda vf=vf, tid=tid: nvidia_vf.set_type(self.host, vf, tid), type=f"nvidia-{tid}",
                           source=source) and not self.dry_run:
                restore_mixed.placement(self, vf, self.w.placements.get(vf), vf=vf)
            self.svc.touch(self.w.gpu, vf)

    def _wait_vf(self, vf: str) -> bool:
        path = self.host.pci(vf) / "nvidia/current_vgpu_type"
        # on a real host the nvidia driver binds new VFs a moment after sriov_numvfs is written
        return path.exists() or (not self.dry_run and not self.host.simulated and wait_for(path.exists, 10.0, 0.1))

    def _type_id(self, vf: str, vtype: str) -> int:
        try:
            return ids.nvidia_type_id(vtype)
        except InvalidInput:
            pass
        known = list(nvidia_vf.creatable(self.host, vf))
        if self.layer is None:  # the driver's catalogue names the types a busy VF no longer lists
            try:
                self.layer = self.svc.nvml()
            except VgpuError:
                pass
        if self.layer is not None:
            g = self.layer.gpus().get(self.w.gpu) or {}
            known += [(t["id"], t["name"]) for t in ((g.get("vgpu") or {}).get("supported_types") or []) if t["name"]]
        low = vtype.lower()
        for tid, name in known:
            if low in (name.lower(), name.split()[-1].lower()):
                return int(tid)
        raise InvalidInput(f"no vGPU type '{vtype}' on {self.w.gpu}",
                           hint="creatable there now: " + (", ".join(f"nvidia-{i} ({n})" for i, n in known[:8]) or
                                                           "none") + "; give nvidia-<id> in the profile")

    # -- 5. mdevs ----------------------------------------------------------------------------------
    def mdevs(self) -> None:
        wanted = {m["uuid"]: m for m in self.w.mdevs}
        if self.vendor_waits:  # e.g. Ascend's VM mode: without it every vNPU is refused
            for uuid, a in sorted(wanted.items()):
                self.step("mdev", uuid, SKIPPED, f"mdev {uuid} ({a['type']} on {a['parent']}): waits for an earlier "
                          f"step: {', '.join(self.vendor_waits)}")
            return
        from vgpumgr.discovery.mdev import discover_mdevs

        for m in discover_mdevs(self.host):
            if self.w.gpu in (m.gpu, m.parent) and m.uuid not in wanted:
                self._in_the_way(m.uuid, f"mdev {m.uuid} ({m.type} on {m.parent}) is not recorded",
                                 lambda m=m: mdev_backend.remove(self.host, m.uuid))
        for uuid, a in sorted(wanted.items()):
            have = mdev_backend.get(self.host, uuid)
            if have and have.parent == a["parent"] and have.type == a["type"]:
                self.step("mdev", uuid, OK_, f"mdev {uuid} exists ({a['type']} on {a['parent']})")
                restore_mixed.placement(self, uuid, self.w.placements.get(uuid), uuid=uuid)
                continue
            if have and not self._in_the_way(uuid, f"mdev {uuid} exists as {have.type} on {have.parent}, "
                                                   f"not {a['type']} on {a['parent']}",
                                             lambda uuid=uuid: mdev_backend.remove(self.host, uuid)):
                continue
            if not self.host.parent(a["parent"]).exists() and self.dry_run and self.vfs_planned:
                self.step("mdev", uuid, PLANNED, f"would create mdev {uuid} ({a['type']} on {a['parent']}) "
                          "once the VFs are enabled")
                continue
            if self.change("mdev", uuid, f"create mdev {uuid} ({a['type']} on {a['parent']}, VM {a['vm'] or '-'})",
                           lambda a=a: mdev_backend.create(self.host, a["parent"], a["type"], a["uuid"]),
                           type=a["type"], parent=a["parent"]) and not self.dry_run:
                restore_mixed.placement(self, uuid, self.w.placements.get(uuid), uuid=uuid)
            self.svc.touch(self.w.gpu, a["parent"])

    def _in_the_way(self, target: str, message: str, remove: Callable[[], Any]) -> bool:
        """Report something vgpumgr did not record; remove it with --force. True once it is (or would be) gone."""
        if not self.force:
            self.unknown.append(target)
            self.step("remove", target, BLOCKED if self._blocks(target) else UNKNOWN, message,
                      hint="left in place; `vgpumgr restore --force` removes it")
            return False
        return self.change("remove", target, f"remove: {message}", remove)

    def _blocks(self, target: str) -> bool:
        """A VF or mdev UUID the records want, or any device while recorded ones are still to be made."""
        return target in self.w.vf_types or target in {m["uuid"] for m in self.w.mdevs}
