"""A VM that vgpumgr starts on a simulated host runs as a guest of the simulated NVML, and stops with it.

On a real host QEMU opens the VM's vGPUs when it starts and the driver reports them as active vGPU instances
until it stops. The simulator has no QEMU: where vgpumgr starts a VM (`vm create --start`, `vm start`, the
libvirt hook's `prepare`), each vGPU the domain names that has a simulated NVML becomes a running guest
(vgpumgr.sim.guests); where it stops one (`vm stop`, `vm delete`, the hook's `release`), they end. On a host
that is not simulated nothing happens here.
"""

from __future__ import annotations

from typing import Any

from vgpumgr.errors import InvalidInput


def _simulated(host: Any) -> bool:
    from vgpumgr.sim.paths import nvml_state_path

    return bool(getattr(host, "simulated", False)) and nvml_state_path(host.root).is_file()


def started(host: Any, name: str, xml: str) -> list[dict[str, Any]]:
    from vgpumgr.sim import guests
    from vgpumgr.virt import migration_xml as migration

    if not _simulated(host):
        return []
    vm_uuid = migration.domain_uuid(xml)
    if vm_uuid is None:
        return []
    out = []
    for v in migration.incoming_vgpus(xml):
        try:
            out.append(guests.start(host.root, v.ref, vm_uuid=vm_uuid, vm_name=name))
        except (ValueError, InvalidInput):
            continue  # a whole GPU, a GPU without a simulated NVML, another vendor's slice (no NVML of theirs)
    return out


def stopped(host: Any, xml: str) -> list[str]:
    """End the domain's guests; returns the GPUs they ran on."""
    from vgpumgr.sim import guests
    from vgpumgr.virt import migration_xml as migration

    if not _simulated(host):
        return []
    vm_uuid = migration.domain_uuid(xml)
    gpus = []
    for inst in guests.running(host.root):
        if vm_uuid and inst["vm_uuid"] == vm_uuid:
            try:
                gpus.append(guests.stop(host.root, inst["id"])["gpu"])
            except ValueError:
                continue  # stopped meanwhile
    return gpus
