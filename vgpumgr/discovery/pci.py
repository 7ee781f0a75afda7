"""PCI facts of GPUs: ids, model name, driver, IOMMU group, NUMA node, SR-IOV PF/VF links."""

from __future__ import annotations

import os

from vgpumgr.discovery.fs import link_name, listdir, read, read_id, read_int, virtfns
from vgpumgr.hostfs.root import Host
from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF, BACKEND_PASSTHROUGH, BACKEND_VF, Gpu, Sriov, unnamed
from vgpumgr.vendors import profiles as vendors

DISPLAY_CLASS = 0x03


def read_function(host: Host, address: str, names: PciNames | None = None) -> Gpu:
    """Facts of one PCI function (a GPU, a VF, or any SR-IOV capable device)."""
    d = str(host.pci(address))
    vendor = read_id(f"{d}/vendor") or "????"
    device = read_id(f"{d}/device") or "????"
    sriov = None
    total = read_int(f"{d}/sriov_totalvfs")
    if total is not None:
        numvfs = read_int(f"{d}/sriov_numvfs", 0) or 0
        sriov = Sriov(totalvfs=total, numvfs=numvfs, vfs=virtfns(d, numvfs))
    backends = []
    if os.path.isdir(f"{d}/mdev_supported_types") and listdir(f"{d}/mdev_supported_types"):
        backends.append(BACKEND_MDEV)
    current = read_int(f"{d}/nvidia/current_vgpu_type")
    if current is not None:
        backends.append(BACKEND_NVIDIA_VF)
    physfn = link_name(f"{d}/physfn")
    group = link_name(f"{d}/iommu_group")
    if physfn is not None and vendor_vf(vendor, device):
        backends.append(BACKEND_VF)
    if physfn is None and group is not None:
        backends.append(BACKEND_PASSTHROUGH)
    return Gpu(
        address=address,
        vendor_id=vendor,
        device_id=device,
        subsystem_vendor_id=read_id(f"{d}/subsystem_vendor"),
        subsystem_device_id=read_id(f"{d}/subsystem_device"),
        class_code=read(f"{d}/class") or "",
        name=(names or PciNames(host)).lookup(vendor, device, address),
        driver=link_name(f"{d}/driver"),
        numa_node=read_int(f"{d}/numa_node", -1) if read_int(f"{d}/numa_node") is not None else -1,
        iommu_group=int(group) if group and group.isdigit() else None,
        physfn=physfn,
        sriov=sriov,
        backends=backends,
        current_vgpu_type=current,
    )


def is_display(host: Host, address: str) -> bool:
    """A display-class function, or a processing accelerator of a vendor in vgpumgr/vendors/profiles.py."""
    cls = read_int(f"{host.pci_devices}/{address}/class")
    if cls is None:
        return False
    if (cls >> 16) == DISPLAY_CLASS:
        return True
    return (cls >> 16) == vendors.ACCELERATOR_CLASS and vendors.is_accelerator(
        read_id(f"{host.pci_devices}/{address}/vendor") or "", cls)  # the vendor read only for class 0x12


def vendor_vf(vendor: str, device: str) -> bool:
    """A VF that a VM gets whole: of a vendor card whose slices are SR-IOV VFs (not an mdev's hidden VF)."""
    p = vendors.profile(vendor, device)
    return p is not None and p.vf_slices


def discover_gpus(host: Host) -> list[Gpu]:
    names = PciNames(host)
    gpus = [read_function(host, a, names) for a in listdir(str(host.pci_devices)) if is_display(host, a)]
    by_addr = {g.address: g for g in gpus}
    for g in gpus:  # a PF offers what its VFs offer
        if g.sriov:
            for vf in g.sriov.vfs:
                for b in by_addr[vf].backends if vf in by_addr else []:
                    if b not in g.backends:
                        g.backends.insert(0, b)
    return gpus


class PciNames:
    """Model names: udev's hwdb (through pyudev) on a real root, else the pci.ids file under the root.
    NVML's name, where NVML knows the GPU, replaces these later (nvml_facts.merge_facts)."""

    PCI_IDS = ("usr/share/misc/pci.ids", "usr/share/hwdata/pci.ids", "usr/share/pci.ids")

    def __init__(self, host: Host) -> None:
        self.host = host
        self._text: str | None = None
        self._udev = None
        self._cache: dict[tuple[str, str], str] = {}

    def lookup(self, vendor: str, device: str, address: str | None = None) -> str:
        key = (vendor, device)
        if key not in self._cache:
            # the project's vendor table first: pci.ids lacks many accelerators, and names others by chip
            self._cache[key] = (vendors.name(vendor, device) or (self.from_udev(address) if address else None)
                                or self._from_pci_ids(vendor, device) or unnamed(vendor, device))
        return self._cache[key]

    def from_udev(self, address: str) -> str | None:
        """udev's hwdb name (ID_VENDOR/MODEL_FROM_DATABASE), when udev has a database for the device."""
        if self.host.simulated or str(self.host.root) != "/" or not os.path.isdir("/run/udev/data"):
            return None
        try:
            import pyudev

            if self._udev is None:
                self._udev = pyudev.Context()
            dev = pyudev.Devices.from_sys_path(self._udev, f"/sys/bus/pci/devices/{address}")
            model = dev.properties.get("ID_MODEL_FROM_DATABASE")
            vendor = dev.properties.get("ID_VENDOR_FROM_DATABASE")
            return f"{vendor.split()[0]} {model}" if model and vendor else model
        except Exception:  # noqa: BLE001 - no udev database is a normal state (containers, no udevd)
            return None

    def _from_pci_ids(self, vendor: str, device: str) -> str | None:
        if self._text is None:
            self._text = ""
            for rel in self.PCI_IDS:
                t = read(str(self.host.root / rel))
                if t:
                    self._text = "\n" + t
                    break
        text = self._text
        v = text.find(f"\n{vendor}  ")
        if v < 0:
            return None
        end = text.find("\n", v + 1)
        vendor_name = text[v + 7:end]
        nxt = v + 1
        while True:  # scan the vendor's block (lines starting with a tab)
            nxt = text.find("\n", nxt)
            if nxt < 0 or nxt + 1 >= len(text) or text[nxt + 1] not in "\t#":
                return None
            if text.startswith(f"\t{device}  ", nxt + 1):
                line_end = text.find("\n", nxt + 1)
                name = text[nxt + 8:line_end if line_end > 0 else None].strip()
                short = vendor_name.split()[0]
                return f"{short} {name}"
            nxt += 1
