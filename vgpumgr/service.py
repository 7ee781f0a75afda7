"""The only place that changes the world, as one object the CLI, the REST API, the hooks and the demo hold.

`Service` is the shared `Context` (lock, transaction, audit, host snapshot) with the use cases of
`vgpumgr.ops` as its methods; the logic lives in those modules, one use case each.
"""

from __future__ import annotations

from vgpumgr.db.session import ensure_schema
from vgpumgr.ops import adopt as adopt_ops
from vgpumgr.ops import allocate as alloc_ops
from vgpumgr.ops import cordon as cordon_ops
from vgpumgr.ops import drain as drain_ops
from vgpumgr.ops import fleet as fleet_ops
from vgpumgr.ops import fleet_compact as fleet_compact_ops
from vgpumgr.ops import hooks as hook_ops
from vgpumgr.ops import idempotency as idem_ops
from vgpumgr.ops import incoming as incoming_ops
from vgpumgr.ops import leases as lease_ops
from vgpumgr.ops import licence_delivery as delivery_ops
from vgpumgr.ops import mig as mig_ops
from vgpumgr.ops import migrate as migrate_ops
from vgpumgr.ops import reconcile as reconcile_ops
from vgpumgr.ops import restore as restore_ops
from vgpumgr.ops import stale as stale_ops
from vgpumgr.ops import telemetry as telemetry_ops
from vgpumgr.ops import vendor as vendor_ops
from vgpumgr.ops import vms as vm_ops
from vgpumgr.ops.context import FAILED, OK, WARNING, Context, Snapshot, hostname
from vgpumgr.ops.records import allocation_dict, hostdev_for, metadata_for

__all__ = ["FAILED", "OK", "WARNING", "Service", "Snapshot", "allocation_dict", "ensure_schema", "hostdev_for",
           "hostname", "metadata_for"]


class Service(Context):
    place = alloc_ops.place
    allocate = alloc_ops.allocate
    allocate_passthrough = alloc_ops.allocate_passthrough
    find_allocation = alloc_ops.find_allocation
    release = alloc_ops.release
    allocations = alloc_ops.allocations
    adopt = adopt_ops.adopt
    check_start = adopt_ops.check_start
    reapply_vf_type = adopt_ops.reapply_vf_type

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
    reap_dead_reservations = lease_ops.reap_locked
    release_stale_records = stale_ops.sweep
    run_once = idem_ops.run_once
    vendor_cards = vendor_ops.cards_of  # other vendors' cards, their mechanism and mode-step state

    # what the host-side hooks ask for (libvirt qemu hook, Proxmox hookscript, OpenStack preparation)
    ensure_vgpu = hook_ops.ensure
    release_vm_vgpus = hook_ops.release_vm
    libvirt_prepare = hook_ops.libvirt_prepare
    libvirt_release = hook_ops.libvirt_release
    libvirt_migrate = hook_ops.libvirt_migrate
    migration_preflight = incoming_ops.preflight
    migration_settle = incoming_ops.settle
    migrate_vm = migrate_ops.migrate_vm
    drain_host = drain_ops.drain
    telemetry = telemetry_ops.telemetry
    licence_check = telemetry_ops.licence_check
    # NVIDIA's licence token and its delivery to the guests (ops/licence_delivery.py)
    set_licence_token = delivery_ops.set_token
    remove_licence_token = delivery_ops.remove_token
    licence_tokens = delivery_ops.tokens
    licence_deliveries = delivery_ops.records
    set_licence_delivery = delivery_ops.set_vm_mode
    set_pool_licence_delivery = delivery_ops.set_pool_mode
    deliver_licence_token = delivery_ops.deliver
    scheduler_check = telemetry_ops.scheduler_check
    proxmox_check = hook_ops.proxmox_check
    proxmox_record = hook_ops.proxmox_record

    restore = restore_ops.restore

    # the fleet: cordon (nothing new is placed here; see ops/cordon.py)
    cordon_host = cordon_ops.cordon_host
    uncordon_host = cordon_ops.uncordon_host
    host_status = cordon_ops.host_status
    # the fleet: what this host publishes, what all hosts published, and a host for a new vGPU
    publish_fleet = fleet_ops.publish
    fleet_hosts = fleet_ops.hosts
    fleet_gpus = fleet_ops.gpus
    fleet_capacity = fleet_ops.capacity
    fleet_place = fleet_compact_ops.place  # fleet_ops.place, and the plan that makes room when nothing fits
    fleet_grid = fleet_ops.grid
    fleet_compact_plan = fleet_compact_ops.plan
    fleet_compact_apply = fleet_compact_ops.apply

