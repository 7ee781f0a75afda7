"""Running vGPUs in the simulated NVML: what NVML reports once a VM has opened its vGPU.

On a real host a vGPU instance exists while a VM (QEMU) has the vGPU open: `nvmlDeviceGetActiveVgpus`
lists them per physical GPU, and `nvmlVgpuInstanceGet*` tell its VM (the libvirt domain UUID on KVM), its
mdev UUID, its type and its GPU instance. The simulator has no QEMU, so a guest is "started" explicitly, by
a test or `vgpumgr sim guest`, on a vGPU that exists in the simulated sysfs (`vgpumgr.sim.guests.start`),
and "stopped" again (`guests.stop`); a simulated reboot ends them all.

State, in the NVML state file: per GPU `"vgpu_instances": [{"id", "uuid", "vm_uuid", "vm_name", "mdev_uuid",
"vf", "type_id", "gi_id", "guest_driver", "started"}]` and a global `"next_vgpu_instance"` (ids are never
reused while the file lives, like NVML's).
"""

from __future__ import annotations

from typing import Any

import pynvml

INVALID_GI = 0xFFFFFFFF  # what NVML answers for the GPU instance of a time-sliced vGPU


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class VgpuInstances:
    """pynvml's vGPU-instance calls, mixed into SimNvml (which supplies `_load` and `_read`)."""

    _load: Any
    _read: Any
    instances: dict[int, tuple[dict[str, Any], dict[str, Any]]]

    def _instance(self, vgpu_instance: int, call: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(gpu entry, instance entry) of an active vGPU; the GPU's lost / NotSupported flags apply."""
        if not vgpu_instance:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._load()
        found = self.instances.get(int(vgpu_instance))  # SimNvml indexes them whenever it reads the state
        if found is None:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        gpu, inst = found
        if gpu.get("lost"):
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        if call in gpu.get("not_supported", ()):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu, inst

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
