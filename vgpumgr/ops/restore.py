"""After a reboot or a driver reload: bring back, from vgpumgr's records (and a boot profile), what the host
had, GPU by GPU and in the order the driver needs it: VFs per PF, MIG mode, GPU instances at their
placements, then VF vGPU types and mdevs with their recorded UUIDs.

Only GPUs the records (or the profile) name are touched. Something in the way (a device nobody recorded,
a VF with another type, a GPU instance on the recorded slices) is reported and removed only with `force`.
Every change is audited; a step already in place is "ok", so a second run changes nothing. A pending MIG
mode that needs a GPU reset is reported, never acted on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vgpumgr import ids
from vgpumgr.discovery.fs import read_id, read_int
from vgpumgr.errors import InvalidInput, VgpuError
from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF
from vgpumgr.ops import boot_records
from vgpumgr.ops import scheduler as scheduler_ops
from vgpumgr.ops.context import FAILED, OK, WARNING, Context
from vgpumgr.ops.restore_steps import BLOCKED, FAILED_, PENDING, GpuRun, Want
from vgpumgr.platforms.boot_profile import BootProfile

Progress = Callable[[dict[str, Any]], None]


def restore(svc: Context, *, dry_run: bool = False, force: bool = False, profile: BootProfile | None = None,
            actor: str | None = None, progress: Progress | None = None) -> dict[str, Any]:
    with svc.locked():
        if not dry_run:  # VFs enabled before restore ran (NVIDIA's or Proxmox's unit, by hand): kept for next time
            with svc.tx() as s:
                boot_records.remember_enabled_vfs(s, svc.host_id(s), svc.snapshot(refresh=True).inventory.gpus)
        wants = desired(svc, profile)
        layer = _nvml(svc) if any(w.mig or w.gis or w.scheduler for w in wants.values()) else None
        reports = []
        for gpu in sorted(wants):
            run = GpuRun(svc, layer, wants[gpu], dry_run=dry_run, force=force, actor=actor)
            try:
                run.all()
            except VgpuError as e:  # a step that cannot go on: the other GPUs still get their turn
                run.step("gpu", gpu, FAILED_, e.message, hint=e.hint)
            report = {"gpu": gpu, "steps": run.steps}
            reports.append(report)
            if progress:
                progress(report)
        svc.invalidate()
        counts: dict[str, int] = {}
        for r in reports:
            for st in r["steps"]:
                counts[st["status"]] = counts.get(st["status"], 0) + 1
        result = {"dry_run": dry_run, "force": force, "profile": profile.path if profile else None,
                  "gpus": reports, "counts": counts}
        if not dry_run:
            outcome = FAILED if counts.get(FAILED_) else WARNING if (counts.get(BLOCKED) or counts.get(PENDING)) else OK
            with svc.tx() as s:
                svc.event(s, "restore", outcome, actor=actor,
                          detail={"counts": counts, "gpus": sorted(wants), "force": force,
                                  "profile": result["profile"]})
        return result


def desired(svc: Context, profile: BootProfile | None) -> dict[str, Want]:
    """Records and profile merged into what each GPU should have; a profile that contradicts the records
    is refused before anything is touched."""
    from vgpumgr.ops.allocate import allocations

    wants: dict[str, Want] = {}

    def want(gpu: str) -> Want:
        return wants.setdefault(gpu, Want(gpu))

    with svc.sessions() as s:
        h = svc.host_id(s)
        states = boot_records.boot_states(s, h)
        gis = boot_records.gpu_instances(s, h)
    for addr, st in states.items():
        if st.numvfs:
            want(addr).numvfs = st.numvfs
        if st.mig_enabled:
            want(addr).mig = True
        if getattr(st, "vgpu_mode", None):  # NVIDIA mixed/equal-size mode (vgpumgr.ops.restore_mixed)
            want(addr).vgpu_mode = st.vgpu_mode
        if st.vendor_state:
            want(addr).vendor = dict(st.vendor_state)
    for gi in gis:
        w = want(gi.gpu)
        w.mig = True
        w.gis.append(gi)
    for gpu, intent in scheduler_ops.intents(svc.cfg).items():  # the vGPU scheduler NVML forgot at the reboot
        want(gpu).scheduler = intent
    for a in allocations(svc, live=True):
        if a.get("placement_id") is not None and a.get("placement_by") == "driver":  # equal size: read, not asked
            want(a["gpu"] or a["parent"]).observed[a["uuid"] or a["pci_address"]] = a["id"]
        elif a.get("placement_id") is not None:
            want(a["gpu"] or a["parent"]).placements[a["uuid"] or a["pci_address"]] = a["placement_id"]
        if a["kernel_owner"] and a["pci_address"]:  # the VF must exist; its type is written at the VM's start
            want(a["gpu"] or a["parent"]).owned_vfs.append(a["pci_address"])
        elif a["backend"] == BACKEND_NVIDIA_VF and a["pci_address"]:
            want(a["gpu"] or a["parent"]).vf_types[a["pci_address"]] = (a["type"], "records")
        elif a["backend"] == BACKEND_MDEV and a["uuid"]:
            want(a["gpu"] or a["parent"]).mdevs.append(a)
    if profile:
        _merge_profile(wants, want, profile)
    for w in wants.values():  # VFs in use but no VF count recorded (records from before 0003): enough for them
        vfs = [*w.vf_types, *w.owned_vfs, *(m["parent"] for m in w.mdevs if m["parent"] != w.gpu)]
        need = max((vf_index(svc.host, w.gpu, v) + 1 for v in vfs if ids.is_pci_address(v)), default=0)
        if need and (w.numvfs or 0) < need:
            if w.numvfs:
                raise InvalidInput(f"{w.gpu}: {w.numvfs} VFs are recorded, but VF {need - 1} is in use",
                                   hint="set the PF's VF count in the profile to at least " + str(need))
            w.numvfs, w.numvfs_source = need, "the VFs in use"
    return wants


def _merge_profile(wants: dict[str, Want], want: Callable[[str], Want], profile: BootProfile) -> None:
    for g in profile.gpus:
        w = want(g.address)
        if g.vfs is not None:
            if w.numvfs and w.numvfs != g.vfs:
                raise InvalidInput(f"the profile gives {g.address} {g.vfs} VFs, the records {w.numvfs}",
                                   hint="make the profile agree with `vgpumgr restore --dry-run --json`")
            w.numvfs, w.numvfs_source = g.vfs, "profile"
        if g.mig or g.gpu_instances:
            w.mig = True
        for gi in g.gpu_instances:
            rec = next((r for r in w.gis if r.start == gi.start), None)
            if rec is not None and rec.profile != gi.profile:
                raise InvalidInput(f"{g.address}: the profile puts {gi.profile} at slice {gi.start}, "
                                   f"the records {rec.profile}", hint="change the profile's start or profile")
            if rec is None:
                w.gis.append(boot_records.RecordedGi(g.address, gi.profile, -1, gi.start, 0, gi.compute_instance))
        for v in g.vf_types:
            have = w.vf_types.get(v.address)
            if have and have[1] == "records":
                raise InvalidInput(f"VF {v.address} is in the profile and is also a vGPU vgpumgr allocated "
                                   f"({have[0]})", hint="leave that VF out of the profile, or release the vGPU")
            w.vf_types[v.address] = (v.type, "profile")


def vf_index(host: Any, pf: str, vf: str) -> int:
    """A VF's index on its PF from PCI routing ids (the VF need not exist yet): offset + index * stride."""
    d = host.pci(pf)
    offset, stride = read_int(f"{d}/sriov_offset"), read_int(f"{d}/sriov_stride")
    if offset is None or not stride:
        raise InvalidInput(f"{pf} is not an SR-IOV physical function, but VF {vf} is named on it",
                           hint="check the PF address")

    def rid(a: str) -> int:
        bus, devfn = a.split(":")[1], a.split(":")[2]
        slot, fn = devfn.split(".")
        return int(bus, 16) << 8 | int(slot, 16) << 3 | int(fn, 16)

    step = rid(vf) - rid(pf) - offset
    if step < 0 or step % stride or vf.split(":")[0] != pf.split(":")[0]:
        raise InvalidInput(f"{vf} is not a VF of {pf}", hint=f"`vgpumgr gpus --vfs` lists the VFs of {pf}")
    return step // stride


def _nvml(svc: Context) -> Any | None:
    try:
        return svc.nvml()
    except VgpuError:
        return None


def vf_pci_ids(host: Any, profile: BootProfile) -> dict[str, tuple[str, str]]:
    """VF -> (vendor id, device id) read from the PF (the VFs need not exist), for Nova's device_spec."""
    out = {}
    for g in profile.gpus:
        d = f"{host.pci(g.address)}"
        vendor, device = read_id(f"{d}/vendor"), read_id(f"{d}/sriov_vf_device")
        if vendor and device:
            for v in g.vf_types:
                out[v.address] = (vendor, device)
    return out


def check_profile(svc: Context, profile: BootProfile) -> list[str]:
    """What in the profile does not fit this host (nothing is changed)."""
    problems: list[str] = []
    host = svc.host
    layer = _nvml(svc) if any(g.mig or g.gpu_instances for g in profile.gpus) else None
    for g in profile.gpus:
        d = host.pci(g.address)
        if not d.exists():
            problems.append(f"{g.address}: no such PCI device")
            continue
        total = read_int(f"{d}/sriov_totalvfs")
        if (g.vfs or g.vf_types) and total is None:
            problems.append(f"{g.address}: not an SR-IOV physical function, but VFs are asked for")
            continue
        if g.vfs is not None and total is not None and g.vfs > total:
            problems.append(f"{g.address}: {g.vfs} VFs asked for, it offers {total}")
        limit = g.vfs if g.vfs is not None else total or 0
        for v in g.vf_types:
            try:
                index = vf_index(host, g.address, v.address)
            except InvalidInput as e:
                problems.append(e.message)
                continue
            if index >= limit:
                problems.append(f"{v.address} is VF {index} of {g.address}, which gets only {limit} VFs")
        if g.mig or g.gpu_instances:
            problems += _check_mig(layer, g)
    try:
        desired(svc, profile)
    except InvalidInput as e:
        problems.append(e.message)
    return problems


def _check_mig(layer: Any | None, g: Any) -> list[str]:
    from vgpumgr.mig import plan as mig

    if layer is None:
        return [f"{g.address}: MIG is asked for, but NVML is not available"]
    try:
        table = layer.mig_table(g.address)
        placed: list[mig.Placed] = []
        for gi in g.gpu_instances:
            prof = table.find(gi.profile)
            placed.append(mig.plan(table, placed, prof, gi.start))
    except VgpuError as e:
        return [f"{g.address}: {e.message}"]
    return []
