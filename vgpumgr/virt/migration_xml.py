"""A migrating domain's vGPUs, read from and written back into its XML (pure: no host, no database).

The destination's `migrate begin` hook gets the incoming domain XML; each vGPU hostdev it names is one
`IncomingVgpu`: an mdev (by UUID), an unmanaged PCI function that vgpumgr's metadata calls an NVIDIA vendor VF,
or a whole GPU passed through (which cannot move live). What the source knew of each vGPU (its allocation
record, and the facts NVIDIA's compatibility check compares) travels in vgpumgr's `<metadata>`
(`MIGRATION_KEY` in each allocation record); `rewrite` puts the destination's choices back: the mdev UUID,
the VF's address, and the records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lxml import etree

from vgpumgr import ids
from vgpumgr.errors import InvalidInput
from vgpumgr.mig.plan import normalise_profile_name, profile_for_type
from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF, BACKEND_PASSTHROUGH
from vgpumgr.nvidia import compat
from vgpumgr.virt.domain import NS, _allocation_element, parse_xml, read_allocations, template

MIGRATION_KEY = "migration"  # per allocation record: what the source knew (see `source_facts`)
FACT_KEYS = ("id", "from_host", "allocation_id", "device_id", "gpu_name", "host_driver", "guest_driver",
             "guest_vgpu_version", "nvml_metadata", "mig_profile", "nvml")


@dataclass
class IncomingVgpu:
    kind: str  # BACKEND_MDEV, BACKEND_NVIDIA_VF or BACKEND_PASSTHROUGH
    ref: str  # the mdev UUID or the PCI address the source used
    record: dict[str, Any] = field(default_factory=dict)  # the source's allocation record, if it travelled

    @property
    def facts(self) -> dict[str, Any]:
        return dict(self.record.get(MIGRATION_KEY) or {})

    @property
    def type_name(self) -> str | None:
        return self.record.get("type_name") or None

    @property
    def mig_profile(self) -> str | None:
        """The GPU-instance profile a MIG-backed vGPU needs, from what any libvirt-driven migration carries:
        NVIDIA's type name (A100D-1-10C: 1g.10gb), the source's facts (`vm migrate`) and vgpumgr's record
        written when the VM was made; None for a time-sliced vGPU. Malformed or disagreeing: InvalidInput."""
        by_type = profile_for_type(self.type_name or "")
        stated = self.facts.get("mig_profile") or self.record.get("mig_profile")
        if not stated:
            return by_type
        stated = normalise_profile_name(str(stated))
        if by_type and stated != by_type:
            raise InvalidInput(f"the domain's vgpumgr metadata gives vGPU {self.ref} ({self.type_name}) the MIG "
                               f"profile {stated}, but its type needs {by_type}",
                               hint="correct or remove the mig_profile field of the domain's vgpumgr metadata")
        return stated

    def migrating(self) -> compat.MigratingVgpu:
        f = self.facts
        return compat.MigratingVgpu(self.type_name or self.record.get("type") or "", device_id=f.get("device_id"),
                                    gpu_name=f.get("gpu_name"), host_driver=f.get("host_driver"),
                                    guest_driver=f.get("guest_driver"), guest_vgpu_version=f.get("guest_vgpu_version"))

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ref": self.ref, "type": self.record.get("type"), "type_name": self.type_name,
                "mig_profile": self.mig_profile}


def _pci(addr: etree._Element | None) -> str | None:
    if addr is None:
        return None
    try:
        dom, bus, slot, fn = (int(addr.get(k, "0"), 0) for k in ("domain", "bus", "slot", "function"))
        return ids.pci_address(f"{dom:04x}:{bus:02x}:{slot:02x}.{fn:x}")
    except (ValueError, InvalidInput):
        return None


def domain_uuid(xml: str) -> str | None:
    text = parse_xml(xml).findtext("uuid")
    return ids.mdev_uuid(text) if text and ids.is_mdev_uuid(text.strip()) else None


def incoming_vgpus(xml: str) -> list[IncomingVgpu]:
    """The vGPU hostdevs of a domain, in document order. A PCI hostdev counts when vgpumgr's metadata names
    it (a VF vGPU or a passthrough GPU) or when libvirt manages it (managed='yes': a whole device)."""
    root = parse_xml(xml)
    if root.tag != "domain":
        raise InvalidInput("the XML is not a libvirt domain", hint="pass the XML libvirt gives the hook")
    records = {r.get("uuid") or r.get("pci_address"): r for r in read_allocations(xml)}
    out = []
    for hd in root.iterfind("devices/hostdev"):
        addr = hd.find("source/address")
        if hd.get("type") == "mdev" and addr is not None and ids.is_mdev_uuid(addr.get("uuid", "")):
            uuid = ids.mdev_uuid(addr.get("uuid"))
            out.append(IncomingVgpu(BACKEND_MDEV, uuid, records.get(uuid, {})))
        elif hd.get("type") == "pci":
            address = _pci(addr)
            if address is None:
                continue
            rec = records.get(address, {})
            if rec.get("backend") == BACKEND_NVIDIA_VF:
                out.append(IncomingVgpu(BACKEND_NVIDIA_VF, address, rec))
            elif rec.get("backend") == BACKEND_PASSTHROUGH or hd.get("managed") == "yes":
                out.append(IncomingVgpu(BACKEND_PASSTHROUGH, address, rec))
    return out


def rewrite(xml: str, chosen: dict[str, dict[str, Any]]) -> str:
    """The domain XML with each vGPU `ref` (mdev UUID or PCI address) moved to its destination record
    (`uuid` / `pci_address` of the allocation made there) and vgpumgr's records replaced by those."""
    root = parse_xml(xml)
    for hd in root.iterfind("devices/hostdev"):
        addr = hd.find("source/address")
        if addr is None:
            continue
        if hd.get("type") == "mdev" and ids.is_mdev_uuid(addr.get("uuid", "")):
            new = chosen.get(ids.mdev_uuid(addr.get("uuid")))
            if new is not None:
                addr.set("uuid", new["uuid"])
        elif hd.get("type") == "pci":
            old = _pci(addr)
            new = chosen.get(old) if old else None
            if new is not None and new.get("pci_address"):
                dom, bus, rest = new["pci_address"].split(":")
                slot, fn = rest.split(".")
                addr.set("domain", f"0x{int(dom, 16):04x}")
                addr.set("bus", f"0x{int(bus, 16):02x}")
                addr.set("slot", f"0x{int(slot, 16):02x}")
                addr.set("function", f"0x{int(fn, 16):x}")
    _replace_records(root, chosen)
    return etree.tostring(root, encoding="unicode")


def _replace_records(root: etree._Element, chosen: dict[str, dict[str, Any]]) -> None:
    for alloc in root.iterfind(f"metadata/{{{NS}}}vm/{{{NS}}}allocation"):
        fields = {f.get("name"): f for f in alloc.iterfind(f"{{{NS}}}field")}
        key = next((f.text for name in ("uuid", "pci_address") if (f := fields.get(name)) is not None and f.text),
                   None)
        if key in chosen:
            alloc.getparent().replace(alloc, _allocation_element(chosen[key]))


def with_facts(xml: str, facts: dict[str, dict[str, Any]]) -> str:
    """The domain XML with `facts` (per mdev UUID or PCI address) stored as each record's MIGRATION_KEY;
    records without facts keep theirs (the source calls this before the migration starts)."""
    records = read_allocations(xml)
    for r in records:
        key = r.get("uuid") or r.get("pci_address")
        if key in facts:
            r[MIGRATION_KEY] = {k: v for k, v in facts[key].items() if k in FACT_KEYS and v is not None}
    return metadata_xml(records)


def metadata_xml(records: list[dict[str, Any]]) -> str:
    """vgpumgr's metadata element for `records` (what virDomainSetMetadata takes)."""
    root = template("metadata.xml")
    for record in records:
        root.append(_allocation_element(record))
    return etree.tostring(root, encoding="unicode")


def persistent_fix(inactive_xml: str, live_xml: str) -> str | None:
    """The destination's persistent definition with the vGPUs its running domain got there.

    libvirt's migrate-begin hook filters the running domain's XML; the persistent definition libvirt keeps
    at the destination comes from the source and still names the source's devices. The hook rewrites the
    vGPU hostdevs in place, so the n-th vGPU of one is the n-th of the other. None: nothing to fix."""
    old, new = incoming_vgpus(inactive_xml), incoming_vgpus(live_xml)
    if len(old) != len(new) or any(o.kind != n.kind for o, n in zip(old, new, strict=True)):
        return None
    chosen = {o.ref: (n.record or ({"uuid": n.ref} if n.kind == BACKEND_MDEV else {"pci_address": n.ref}))
              for o, n in zip(old, new, strict=True) if o.ref != n.ref or o.record != n.record}
    return rewrite(inactive_xml, chosen) if chosen else None
