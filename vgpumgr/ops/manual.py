"""Device changes an admin makes by hand (`vgpumgr mdev|vf|sriov|vfio|mig|scheduler ...`): the change in the
kernel or NVML first, then its audit event and, where `vgpumgr restore` needs it, its boot record.

These take only the `Config`: no allocation record is involved, so no host lock and no Service start. The
change has happened once the kernel accepted it, so a database that cannot be written (no permission, a full
disk) is reported as a warning on stderr, never as a failure of a change that was made.
"""

from __future__ import annotations

import sys
from typing import Any

from vgpumgr import ids
from vgpumgr.config import Config
from vgpumgr.errors import InvalidInput, NotFound, Unavailable
from vgpumgr.model import Mdev, VgpuType


def audited(cfg: Config, action: str, **kw: Any) -> None:
    from vgpumgr.ops.context import record_event

    try:
        record_event(cfg, action, **kw)
    except Exception as e:  # noqa: BLE001
        sys.stderr.write(f"vgpumgr: warning: {action} done, but not recorded in the audit log ({cfg.db_url}): "
                         f"{type(e).__name__}: {e}\n")


def _boot_record(cfg: Config, what: str, *args: Any) -> None:
    """Keep what `vgpumgr restore` brings back after a reboot in step with a manual change."""
    from vgpumgr.ops import boot_records

    try:
        boot_records.note(cfg, getattr(boot_records, what), *args)
    except Exception as e:  # noqa: BLE001
        sys.stderr.write(f"vgpumgr: warning: done, but `vgpumgr restore` will not know of it: {e}\n")


def _libvirt_holders(cfg: Config, kind: str):  # noqa: ANN202
    from vgpumgr.virt.holders import holder_check

    return holder_check(cfg.libvirt_uri, cfg.state_dir, kind)


# -- mdevs, VF vGPU types, SR-IOV, vfio-pci ------------------------------------------------------------
def mdev_create(cfg: Config, parent: str, t: VgpuType, uuid: str | None) -> Mdev:
    from vgpumgr.backends import mdev

    dev = mdev.create(cfg.host, parent, t.type, uuid)
    audited(cfg, "mdev.create", vgpu=dev.uuid, gpu=dev.gpu, detail={"parent": parent, "type": t.type})
    return dev


def mdev_remove(cfg: Config, uuid: str, grace: float = 0.0) -> Mdev:
    from vgpumgr.backends import mdev

    uuid = ids.mdev_uuid(uuid)
    dev = mdev.get(cfg.host, uuid)
    if dev is None:
        raise NotFound(f"no mdev {uuid}", hint="`vgpumgr mdev list` shows the active mdevs")
    mdev.remove(cfg.host, uuid, grace=grace, holder_check=_libvirt_holders(cfg, "mdev"))
    audited(cfg, "mdev.remove", vgpu=uuid, gpu=dev.gpu, detail={"parent": dev.parent, "type": dev.type})
    return dev


def vf_type_id(cfg: Config, vf: str, wanted: str) -> int:
    """A type id from `nvidia-N`, `N`, or a name the VF can take now."""
    from vgpumgr.backends import nvidia_vf

    w = wanted.strip()
    if w.isdigit() or (w.startswith("nvidia-") and w[7:].isdigit()):
        return ids.nvidia_type_id(w)
    for tid, name in nvidia_vf.creatable(cfg.host, vf):
        if w in (name, name.split()[-1]):
            return tid
    raise InvalidInput(f"'{wanted}' is not a type creatable on {vf}",
                       hint=f"`vgpumgr types --parent {vf}` lists what it can take now")


def vf_set(cfg: Config, vf: str, wanted: str) -> int:
    from vgpumgr.backends import nvidia_vf

    vf = ids.pci_address(vf)
    tid = nvidia_vf.set_type(cfg.host, vf, vf_type_id(cfg, vf, wanted))
    audited(cfg, "vf.set", vgpu=vf, detail={"type": f"nvidia-{tid}"})
    return tid


def vf_clear(cfg: Config, vf: str, retries: int = 10) -> bool:
    from vgpumgr.backends import nvidia_vf

    vf = ids.pci_address(vf)
    changed = nvidia_vf.clear_type(cfg.host, vf, retries=max(1, retries), holder_check=_libvirt_holders(cfg, "pci"))
    if changed:
        audited(cfg, "vf.clear", vgpu=vf)
    return changed


def sriov_set(cfg: Config, pf: str, count: int, allow_nvidia: bool = False) -> list[str]:
    from vgpumgr.backends import sriov

    pf = ids.pci_address(pf)
    vfs = sriov.set_numvfs(cfg.host, pf, count, allow_nvidia=allow_nvidia)
    audited(cfg, "sriov.set", gpu=pf, detail={"numvfs": count})
    _boot_record(cfg, "remember_numvfs", pf, len(vfs))
    return vfs


def vfio_bind(cfg: Config, address: str) -> str | None:
    from vgpumgr.backends import passthrough

    prev = passthrough.bind_vfio(cfg.host, address, passthrough.DriverMemory(cfg.state_dir))
    audited(cfg, "vfio.bind", gpu=ids.pci_address(address), detail={"previous_driver": prev})
    return prev


def vfio_unbind(cfg: Config, address: str) -> str | None:
    from vgpumgr.backends import passthrough

    prev = passthrough.unbind_vfio(cfg.host, address, passthrough.DriverMemory(cfg.state_dir),
                                   holder_check=_libvirt_holders(cfg, "pci"))
    audited(cfg, "vfio.unbind", gpu=ids.pci_address(address), detail={"restored_driver": prev})
    return prev


# -- MIG and the vGPU scheduler, through NVML ---------------------------------------------------------
def nvml(cfg: Config) -> Any:
    from vgpumgr.nvidia.facts import nvml_layer

    layer = nvml_layer(cfg)
    if layer is None or not layer.open():
        raise Unavailable(getattr(layer, "notice", None) or "NVML is not available for this root",
                          hint="MIG and scheduler commands need NVIDIA's NVML (or a simulated host with one)")
    return layer


def mig_create(cfg: Config, gpu: str, profile: str, start: int | None = None,
               compute_instance: bool = False) -> dict[str, Any]:
    gpu, layer = ids.pci_address(gpu), nvml(cfg)
    res = layer.create_gpu_instance(gpu, profile, start=start, compute_instance=compute_instance)
    cfg.host.kernel.gpu_instances_changed(layer)
    audited(cfg, "mig.gi.create", gpu=gpu, detail=res)
    _boot_record(cfg, "remember_gpu_instance", gpu, res)
    return res


def mig_destroy(cfg: Config, gpu: str, gi: int) -> dict[str, Any]:
    gpu, layer = ids.pci_address(gpu), nvml(cfg)
    res = layer.destroy_gpu_instance(gpu, gi)
    cfg.host.kernel.gpu_instances_changed(layer)
    audited(cfg, "mig.gi.destroy", gpu=gpu, detail=res)
    _boot_record(cfg, "forget_gpu_instance", gpu, res["start"])
    return res


def mig_mode(cfg: Config, gpu: str, on: bool) -> dict[str, Any]:
    """MIG mode on or off; on a GPU that needs a reset first, the new mode is reported as pending."""
    gpu, layer = ids.pci_address(gpu), nvml(cfg)
    res = layer.set_mig_mode(gpu, on)
    cfg.host.kernel.gpu_instances_changed(layer)
    audited(cfg, "mig.mode", gpu=gpu, detail=res)
    _boot_record(cfg, "remember_mig_mode", gpu, on)
    return res
