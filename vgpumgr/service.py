"""The only place that changes the world, as one object the CLI, the REST API, the hooks and the demo hold.

`Service` is the shared `Context` (lock, transaction, audit, host snapshot) with the use cases of
`vgpumgr.ops` as its methods; the logic lives in those modules, one use case each.
"""

from __future__ import annotations

from typing import Any

from vgpumgr import audit
from vgpumgr.config import Config
from vgpumgr.db.session import ensure_schema, session_factory
from vgpumgr.ops import allocate as alloc_ops
from vgpumgr.ops import mig as mig_ops
from vgpumgr.ops import reconcile as reconcile_ops
from vgpumgr.ops import restore as restore_ops
from vgpumgr.ops import vms as vm_ops
from vgpumgr.ops.context import FAILED, OK, WARNING, Context, Snapshot, hostname
from vgpumgr.ops.records import allocation_dict, hostdev_for, metadata_for

__all__ = ["FAILED", "OK", "WARNING", "Service", "Snapshot", "allocation_dict", "ensure_schema", "hostdev_for",
           "hostname", "metadata_for", "record_event"]


class Service(Context):
    place = alloc_ops.place
    allocate = alloc_ops.allocate
    allocate_passthrough = alloc_ops.allocate_passthrough
    find_allocation = alloc_ops.find_allocation
    release = alloc_ops.release
    allocations = alloc_ops.allocations

    create_vm = vm_ops.create_vm
    delete_vm = vm_ops.delete_vm
    start_vm = vm_ops.start_vm
    stop_vm = vm_ops.stop_vm
    list_vms = vm_ops.list_vms
    vm = vm_ops.vm
    vm_xml = vm_ops.vm_xml
    attach_vgpu = vm_ops.attach_vgpu
    detach_vgpu = vm_ops.detach_vgpu

    allocate_mig = mig_ops.allocate_mig
    free_gpu_instances = mig_ops.free_gpu_instances

    reconcile = reconcile_ops.reconcile

    restore = restore_ops.restore


def record_event(cfg: Config, action: str, *, outcome: str = OK, gpu: str | None = None, vm: str | None = None,
                 vgpu: str | None = None, error: str | None = None, detail: dict[str, Any] | None = None) -> None:
    """Audit a change made outside the allocation flow (manual mdev/VF/SR-IOV/vfio commands)."""
    ensure_schema(cfg.db_url)
    with session_factory(cfg.db_url).begin() as s:
        audit.append(s, actor=cfg.actor, action=action, outcome=outcome, host=hostname(), gpu=gpu, vm=vm,
                     vgpu=vgpu, error=error, detail=detail)
