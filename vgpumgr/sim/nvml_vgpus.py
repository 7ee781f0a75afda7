"""Running vGPUs in the simulated NVML: what NVML reports once a VM has opened its vGPU.

On a real host a vGPU instance exists while a VM (QEMU) has the vGPU open: `nvmlDeviceGetActiveVgpus`
lists them per physical GPU, and `nvmlVgpuInstanceGet*` tell its VM (the libvirt domain UUID on KVM), its
mdev UUID, its type and its GPU instance. The simulator has no QEMU, so a guest is "started" explicitly, by
a test or `vgpumgr sim guest`, on a vGPU that exists in the simulated sysfs (`start`), and "stopped" again
(`stop`); a simulated reboot ends them all.

State, in the NVML state file: per GPU `"vgpu_instances": [{"id", "uuid", "vm_uuid", "vm_name", "mdev_uuid",
"vf", "type_id", "gi_id", "guest_driver", "started"}]` and a global `"next_vgpu_instance"` (ids are never
reused while the file lives, like NVML's).
"""

from __future__ import annotations

import time
import uuid as uuidlib
from pathlib import Path
from typing import Any

import pynvml

from vgpumgr import ids

INVALID_GI = 0xFFFFFFFF  # what NVML answers for the GPU instance of a time-sliced vGPU


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class VgpuInstances:
    """pynvml's vGPU-instance calls, mixed into SimNvml (which supplies `_load` and `_read`)."""

    _load: Any
    _read: Any

    def _instance(self, vgpu_instance: int, call: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(gpu entry, instance entry) of an active vGPU; the GPU's lost / NotSupported flags apply."""
        if not vgpu_instance:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for gpu in self._load()["gpus"]:
            for inst in gpu.get("vgpu_instances", ()):
                if inst["id"] == int(vgpu_instance):
                    if gpu.get("lost"):
                        raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
                    if call in gpu.get("not_supported", ()):
                        raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
                    return gpu, inst
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetActiveVgpus(self, handle: Any) -> list[int]:  # noqa: N802 - pynvml's names
        gpu, _spec = self._read(handle, "nvmlDeviceGetActiveVgpus")
        return [inst["id"] for inst in gpu.get("vgpu_instances", ())]

    def nvmlVgpuInstanceGetVmID(self, vgpu_instance: int) -> tuple[str, int]:  # noqa: N802
        inst = self._instance(vgpu_instance, "nvmlVgpuInstanceGetVmID")[1]
        return inst["vm_uuid"], pynvml.NVML_VGPU_VM_ID_UUID

    def nvmlVgpuInstanceGetUUID(self, vgpu_instance: int) -> str:  # noqa: N802
        return self._instance(vgpu_instance, "nvmlVgpuInstanceGetUUID")[1]["uuid"]

    def nvmlVgpuInstanceGetMdevUUID(self, vgpu_instance: int) -> str:  # noqa: N802
        # [unverified] a vGPU on NVIDIA's vendor-specific VF interface has no mdev: answered as an empty string
        return self._instance(vgpu_instance, "nvmlVgpuInstanceGetMdevUUID")[1]["mdev_uuid"] or ""

    def nvmlVgpuInstanceGetType(self, vgpu_instance: int) -> int:  # noqa: N802
        return self._instance(vgpu_instance, "nvmlVgpuInstanceGetType")[1]["type_id"]

    def nvmlVgpuInstanceGetGpuInstanceId(self, vgpu_instance: int) -> int:  # noqa: N802
        gi = self._instance(vgpu_instance, "nvmlVgpuInstanceGetGpuInstanceId")[1]["gi_id"]
        return INVALID_GI if gi is None else gi

    def nvmlVgpuInstanceGetVmDriverVersion(self, vgpu_instance: int) -> str:  # noqa: N802
        # NVML answers "Not Available" until the guest driver has loaded
        return self._instance(vgpu_instance, "nvmlVgpuInstanceGetVmDriverVersion")[1]["guest_driver"] or "Not Available"


# -- the simulator's side: guests start and stop -------------------------------------------------------
def _layer(root: Path) -> Any:
    from vgpumgr.sim.nvml import SimNvml
    from vgpumgr.sim.platform import nvml_state_path

    path = nvml_state_path(root)
    if not path.is_file():
        raise ValueError(f"the simulated host at {root} has no simulated NVML (profiles with one: l40s-vfio, "
                         "a100-mig, h100-mig, mixed)")
    nvml = SimNvml(path)
    nvml.nvmlInit()
    return nvml


def _device(root: Path, ref: str) -> tuple[str, str, str | None, str | None]:
    """(physical GPU address, type dir, mdev UUID, VF address) of the vGPU `ref` in the simulated sysfs."""
    from vgpumgr.host import Host
    from vgpumgr.inventory import scan

    inv = scan(Host(root))
    if ids.is_pci_address(ref):
        address = ids.pci_address(ref)
        vf = next((v for v in inv.vf_vgpus if v.address == address), None)
        if vf is not None:
            return vf.gpu, vf.type, None, address
        raise ValueError(f"{address} holds no vGPU type (a guest can only start on an existing vGPU)")
    uuid = ids.mdev_uuid(ref)
    mdev = next((m for m in inv.mdevs if m.uuid == uuid), None)
    if mdev is None or mdev.gpu is None:
        raise ValueError(f"no NVIDIA mdev {uuid} on the simulated host (a guest can only start on an existing vGPU)")
    vf = mdev.parent if mdev.parent != mdev.gpu else None
    return mdev.gpu, mdev.type, uuid, vf


def start(root: str | Path, ref: str, *, vm_uuid: str, vm_name: str | None = None,
          guest_driver: str | None = None) -> dict[str, Any]:
    """A VM opens the vGPU `ref` (mdev UUID or VF address): it becomes an active vGPU instance."""
    root = Path(root)
    vm_uuid = ids.mdev_uuid(vm_uuid)  # a domain UUID has the same form
    gpu_address, type_dir, mdev_uuid, vf = _device(root, ref)
    type_id = ids.nvidia_type_id(type_dir)
    nvml = _layer(root)
    with nvml._mutate() as state:
        gpu = next((g for g in state["gpus"] if g["address"] == gpu_address), None)
        if gpu is None:
            raise ValueError(f"GPU {gpu_address} has no simulated NVML")
        actives = gpu.setdefault("vgpu_instances", [])
        if any((mdev_uuid and i["mdev_uuid"] == mdev_uuid) or (vf and not mdev_uuid and i["vf"] == vf)
               for i in actives):
            raise ValueError(f"a guest already runs on {ref}")
        spec_type = nvml._type(type_id)
        inst = {"id": state.get("next_vgpu_instance", 1), "uuid": str(uuidlib.uuid4()), "vm_uuid": vm_uuid,
                "vm_name": vm_name, "mdev_uuid": mdev_uuid, "vf": vf, "type_id": type_id,
                "gi_id": _free_gpu_instance(gpu, actives, spec_type.gi_profile_id), "guest_driver": guest_driver,
                "started": time.time()}
        state["next_vgpu_instance"] = inst["id"] + 1
        actives.append(inst)
    return dict(inst, gpu=gpu_address)


def _free_gpu_instance(gpu: dict[str, Any], actives: list[dict[str, Any]], profile_id: int | None) -> int | None:
    """A MIG-backed vGPU runs on a GPU instance of its profile that no other running vGPU uses."""
    if profile_id is None:
        return None
    taken = {i["gi_id"] for i in actives}
    for gi in gpu["gpu_instances"]:
        if gi["profile_id"] == profile_id and gi["id"] not in taken:
            return gi["id"]
    raise ValueError(f"no free GPU instance of profile {profile_id} on {gpu['address']} for this MIG-backed vGPU")


def stop(root: str | Path, ref: str | int) -> dict[str, Any]:
    """The VM lets the vGPU go (shut down, migrated away): its instance ends. `ref`: mdev UUID, VF address,
    VM UUID or instance id."""
    nvml = _layer(Path(root))
    key = str(ref).strip().lower()
    with nvml._mutate() as state:
        for gpu in state["gpus"]:
            for inst in gpu.get("vgpu_instances", ()):
                if key in (str(inst["id"]), inst["mdev_uuid"], inst["vf"], inst["vm_uuid"]):
                    gpu["vgpu_instances"].remove(inst)
                    return dict(inst, gpu=gpu["address"])
    raise ValueError(f"no running guest on {ref}")


def running(root: str | Path) -> list[dict[str, Any]]:
    """Every active vGPU instance, with its GPU's address."""
    state = _layer(Path(root))._load()
    return [dict(inst, gpu=gpu["address"]) for gpu in state["gpus"] for inst in gpu.get("vgpu_instances", ())]
