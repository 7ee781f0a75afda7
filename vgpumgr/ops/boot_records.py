"""The records `vgpumgr restore` works from besides the allocations: VFs per PF, MIG mode, GPU instances.

They are written where vgpumgr enables VFs, allocates on a VF, switches MIG mode or makes/uses a GPU
instance, inside the caller's transaction (`remember_*`), or in one of their own (`note_*`, for the
manual CLI commands that have no service).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from vgpumgr import ids
from vgpumgr.db import store
from vgpumgr.db.models import GpuBootState, MigGpuInstance
from vgpumgr.discovery.fs import read_int
from vgpumgr.hostfs.root import Host


@dataclass(frozen=True)
class RecordedGi:
    gpu: str
    profile: str
    profile_id: int
    start: int
    size: int
    compute_instance: bool = False


def _state_row(s: Session, host_id: int, address: str) -> GpuBootState:
    row = s.scalars(select(GpuBootState).where(GpuBootState.host_id == host_id,
                                               GpuBootState.address == address)).first()
    if row is None:
        row = GpuBootState(host_id=host_id, address=address)
        s.add(row)
    return row


def remember_numvfs(s: Session, host_id: int, pf: str, numvfs: int) -> None:
    row = _state_row(s, host_id, ids.pci_address(pf))
    if row.numvfs != numvfs:
        row.numvfs = numvfs


def remember_vfs_of(s: Session, host_id: int, host: Host, pf: str) -> None:
    """The PF's VF count as the kernel has it now (after an allocation on one of its VFs)."""
    n = read_int(f"{host.pci(pf)}/sriov_numvfs", 0) or 0
    if n:
        remember_numvfs(s, host_id, pf, n)


def remember_enabled_vfs(s: Session, host_id: int, gpus: Iterable[Any]) -> list[str]:
    """The VF count of every NVIDIA SR-IOV GPU (inventory `gpus`) that has VFs enabled now, vGPUs on them or not:
    a reboot or a driver reload takes them, and `restore` gives them back. Returns the PFs whose record changed."""
    seen = {g.address: g.sriov.numvfs for g in gpus
            if g.vendor_id == "10de" and g.physfn is None and g.sriov is not None and g.sriov.numvfs}
    if not seen:
        return []
    rows = boot_states(s, host_id)
    changed = []
    for address, n in sorted(seen.items()):
        row = rows.get(address)
        if row is None:
            row = GpuBootState(host_id=host_id, address=address)
            s.add(row)
        if row.numvfs != n:
            row.numvfs = n
            changed.append(address)
    return changed


def remember_vendor(s: Session, host_id: int, pf: str, state: dict[str, Any]) -> None:
    """Vendor mode steps to bring back after a reboot (vgpumgr/vendors/steps.py), merged step by step."""
    if not state:
        return
    row = _state_row(s, host_id, ids.pci_address(pf))
    merged = {**(row.vendor_state or {}), **state}
    if merged != row.vendor_state:
        row.vendor_state = merged  # a new dict: the JSON column sees the change


def remember_mig_mode(s: Session, host_id: int, gpu: str, enabled: bool) -> None:
    row = _state_row(s, host_id, ids.pci_address(gpu))
    if row.mig_enabled is not enabled:
        row.mig_enabled = enabled
    if not enabled:
        s.execute(delete(MigGpuInstance).where(MigGpuInstance.host_id == host_id, MigGpuInstance.gpu == row.address))


def remember_vgpu_mode(s: Session, host_id: int, gpu: str, mode: str) -> None:
    """NVIDIA's vGPU mode of a GPU ("mixed" or "equal"), as `vgpumgr gpu mode` set it."""
    row = _state_row(s, host_id, ids.pci_address(gpu))
    if row.vgpu_mode != mode:
        row.vgpu_mode = mode


def remember_gpu_instance(s: Session, host_id: int, gpu: str, gi: dict[str, Any]) -> None:
    """A GI as the NVML layer reports it (profile, profile_id, start, size, compute_instances)."""
    gpu = ids.pci_address(gpu)
    remember_mig_mode(s, host_id, gpu, True)
    row = s.scalars(select(MigGpuInstance).where(MigGpuInstance.host_id == host_id, MigGpuInstance.gpu == gpu,
                                                 MigGpuInstance.start == int(gi["start"]))).first()
    with_ci = bool(gi.get("compute_instances"))
    if row is None:
        s.add(MigGpuInstance(host_id=host_id, gpu=gpu, profile=str(gi["profile"]), profile_id=int(gi["profile_id"]),
                             start=int(gi["start"]), size=int(gi["size"]), compute_instance=with_ci))
    else:
        row.profile, row.profile_id, row.size = str(gi["profile"]), int(gi["profile_id"]), int(gi["size"])
        row.compute_instance = row.compute_instance or with_ci


def forget_gpu_instance(s: Session, host_id: int, gpu: str, start: int) -> None:
    s.execute(delete(MigGpuInstance).where(MigGpuInstance.host_id == host_id,
                                           MigGpuInstance.gpu == ids.pci_address(gpu), MigGpuInstance.start == start))


def boot_states(s: Session, host_id: int) -> dict[str, GpuBootState]:
    return {r.address: r for r in s.scalars(select(GpuBootState).where(GpuBootState.host_id == host_id))}


def gpu_instances(s: Session, host_id: int) -> list[RecordedGi]:
    rows = s.scalars(select(MigGpuInstance).where(MigGpuInstance.host_id == host_id)
                     .order_by(MigGpuInstance.gpu, MigGpuInstance.start))
    return [RecordedGi(r.gpu, r.profile, r.profile_id, r.start, r.size, bool(r.compute_instance)) for r in rows]


def note(cfg: Any, fn: Any, *args: Any) -> None:
    """Run one `remember_*`/`forget_*` in a transaction of its own (the manual CLI commands)."""
    from vgpumgr.db.session import ensure_schema, session_factory
    from vgpumgr.ops.context import hostname

    ensure_schema(cfg.db_url)
    with session_factory(cfg.db_url).begin() as s:
        fn(s, store.upsert_host(s, hostname()).id, *args)
