"""What the checks read, each read once per run and each through the host root: files under it (sysfs, /proc,
/dev, /boot, EFI variables) and systemd's unit states through `Host.kernel.unit_state` (the seam a simulated
root answers itself)."""

from __future__ import annotations

import re
from functools import cached_property
from typing import Any

from vgpumgr import ids
from vgpumgr.config import Config
from vgpumgr.model import Gpu
from vgpumgr.ops import support_matrix

NVIDIA = "10de"
SECURE_BOOT_VAR = "sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
VENDOR_VF_KERNEL = (6, 8)


class Facts:
    def __init__(self, cfg: Config, gpu: str | None = None) -> None:
        self.cfg, self.host = cfg, cfg.host
        self.only_gpu = ids.pci_address(gpu) if gpu else None
        self._units: dict[str, dict[str, str]] = {}

    # -- files under the root
    def text(self, rel: str) -> str | None:
        try:
            return (self.host.root / rel).read_text(errors="replace")
        except OSError:
            return None

    def exists(self, rel: str) -> bool:
        return (self.host.root / rel).exists()

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(p.name for p in (self.host.root / rel).iterdir())
        except OSError:
            return []

    @cached_property
    def cpu_flags(self) -> set[str] | None:
        """The flags of /proc/cpuinfo (x86 `flags`, ARM `Features`); None when it cannot be read."""
        text = self.text("proc/cpuinfo")
        if text is None:
            return None
        flags: set[str] = set()
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip().lower() in ("flags", "features", "facilities"):
                flags |= set(value.split())
        return flags

    @cached_property
    def modules(self) -> set[str] | None:
        text = self.text("proc/modules")
        return None if text is None else {line.split()[0] for line in text.splitlines() if line.strip()}

    def module_loaded(self, name: str) -> bool:
        """Loaded as a module (/proc/modules) or built in (/sys/module/NAME exists for both)."""
        return name in (self.modules or ()) or self.exists(f"sys/module/{name}")

    @cached_property
    def cmdline(self) -> str:
        return (self.text("proc/cmdline") or "").strip()

    @cached_property
    def kernel(self) -> str | None:
        return (self.text("proc/sys/kernel/osrelease") or "").strip() or None

    @property
    def kernel_tuple(self) -> tuple[int, ...]:
        return support_matrix.version_tuple(self.kernel)[:2]

    @cached_property
    def secure_boot(self) -> bool | None:
        try:
            data = (self.host.root / SECURE_BOOT_VAR).read_bytes()
        except OSError:
            return None
        return len(data) >= 5 and data[4] == 1

    @cached_property
    def nvidia_version(self) -> str | None:
        """The loaded NVIDIA kernel module's version: /sys/module/nvidia/version, /proc/driver/nvidia/version,
        else what NVML says (a simulated host has only NVML's)."""
        text = (self.text("sys/module/nvidia/version") or "").strip()
        if text:
            return text
        proc = self.text("proc/driver/nvidia/version") or ""
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", proc)
        if m:
            return m.group(1)
        return self.nvml_driver.get("driver_version")

    @cached_property
    def nvml_driver(self) -> dict[str, Any]:
        from vgpumgr.nvidia.facts import nvml_layer

        layer = nvml_layer(self.cfg)
        if layer is None:
            return {}
        try:
            return layer.driver() if layer.open() else {}
        finally:
            layer.close()

    def unit(self, name: str) -> dict[str, str]:
        if name not in self._units:
            self._units[name] = self.host.kernel.unit_state(name)
        return self._units[name]

    # -- devices
    @cached_property
    def gpus(self) -> list[Gpu]:
        from vgpumgr.discovery.pci import discover_gpus
        from vgpumgr.nvidia.facts import merge_nvml

        found = discover_gpus(self.host)
        merge_nvml(self.cfg, found, quiet=True)
        return found

    @cached_property
    def by_address(self) -> dict[str, Gpu]:
        return {g.address: g for g in self.gpus}

    @property
    def physical(self) -> list[Gpu]:
        """The physical GPUs and accelerators checked (every one, or --gpu's)."""
        return [g for g in self.gpus if g.physfn is None and (self.only_gpu is None or g.address == self.only_gpu)]

    @property
    def nvidia(self) -> list[Gpu]:
        return [g for g in self.physical if g.vendor_id == NVIDIA]

    def vfs(self, pf: Gpu) -> list[Gpu]:
        return [self.by_address[v] for v in (pf.sriov.vfs if pf.sriov else []) if v in self.by_address]

    def mdev_parents(self) -> list[str]:
        return self.listdir("sys/class/mdev_bus")

    @cached_property
    def iommu_groups(self) -> list[str]:
        """The IOMMU groups that hold a PCI function, in number order. Every mdev gets a group of its own even
        without an IOMMU (vfio-mdev makes them), so those do not say the IOMMU is on."""
        groups = [g for g in self.listdir("sys/kernel/iommu_groups") if g.isdigit()]
        return sorted((g for g in groups if any(ids.is_pci_address(d) for d in self.iommu_members(int(g)))), key=int)

    def iommu_members(self, group: int | None) -> list[str]:
        return [] if group is None else self.listdir(f"sys/kernel/iommu_groups/{group}/devices")

    # -- records
    @cached_property
    def records(self) -> dict[str, Any] | None:
        """gpu_boot_state rows of this host (read only), or None when the database cannot be read."""
        from vgpumgr.ops.doctor.records import boot_states

        return boot_states(self.cfg)
