"""Use cases: each module changes the world through one `Context` (lock, transaction, audit event).

allocate.py  place, allocate, release (mdev and VF vGPUs, whole-GPU passthrough)
vms.py       VM create/delete/start/stop/attach/detach around those allocations
mig.py       MIG-backed vGPUs: find or make a GPU instance, then allocate on it
reconcile.py records against sysfs
The CLI, the REST routes and the hooks call these through `vgpumgr.service.Service`.
Layer 6 (use cases): may import every layer below, and fleet and telemetry beside it.
"""
