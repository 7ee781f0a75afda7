"""VM spec -> libvirt domain XML, built from `xml_templates/` with lxml and checked against libvirt's schema.

Every value goes into the tree through lxml (attribute or text), never through string formatting, so a
name or path with `<`, `&` or quotes is escaped and cannot change the document's structure. Each rendered
document passes readable semantic checks first and then RelaxNG validation against `domain.rng`.

Device classes follow virtinst's shape: one class per XML element, properties mapped to XML paths.

Long because: one small class per XML device (passthrough, mdev, VF, graphics, disk, interface, metadata)
plus the semantic checks that give readable errors before RelaxNG's.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

from lxml import etree

from vgpumgr import ids
from vgpumgr.errors import InvalidInput
from vgpumgr.resources import data_dir

NS = "https://vgpumgr.dev/xmlns/vgpumgr/1"
NS_PREFIX = "vgpumgr"
DOMAIN_RNG = Path(os.environ.get("VGPUMGR_DOMAIN_RNG", "/usr/share/libvirt/schemas/domain.rng"))

HOSTDEV_KINDS = ("passthrough", "mdev", "nvidia-vf")
DOMAIN_TYPES = ("kvm", "qemu")
FIRMWARES = ("bios", "uefi")
MDEV_MODELS = ("vfio-pci", "vfio-ccw", "vfio-ap")
_NETWORK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_BRIDGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,14}$")  # Linux IFNAMSIZ is 16 with the NUL
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_MEMORY_MIB = 16 * 1024 * 1024
MAX_VCPUS = 4096


# -- the spec ----------------------------------------------------------------------------------------
@dataclass
class Hostdev:
    """One GPU device of a VM."""

    kind: str  # "passthrough" | "mdev" | "nvidia-vf"
    address: str | None = None  # PCI address for passthrough / nvidia-vf
    uuid: str | None = None  # mdev UUID
    display: bool = False  # mdev only: display='on', ramfb on the first one, VNC graphics and video none


@dataclass
class VmSpec:
    name: str
    uuid: str | None = None
    memory_mib: int = 4096
    vcpus: int = 2
    firmware: str = "bios"
    disk: str | None = None  # absolute path of a qcow2/raw image
    network: str | None = None  # "default" (libvirt network), "network:NAME" or "bridge:br0"
    hostdevs: list[Hostdev] = field(default_factory=list)
    allocations: list[dict[str, Any]] = field(default_factory=list)
    # "kvm" (hardware virtualisation, the CPU passed through) or "qemu" (software emulation, QEMU's default
    # CPU model): a nested or PVM host without usable KVM can only run the latter
    domain_type: str = "kvm"
    # fw_cfg items for the guest, (name under opt/, host file QEMU reads): the licence token's copy
    fwcfg: list[tuple[str, str]] = field(default_factory=list)


# -- templates and XML-backed device classes -------------------------------------------------------------
@functools.cache
def _template_tree(name: str) -> etree._Element:
    path = data_dir("xml_templates") / name
    try:
        return etree.parse(str(path), etree.XMLParser(remove_blank_text=True)).getroot()
    except OSError as exc:
        raise InvalidInput(f"XML template {path} cannot be read: {exc}",
                           hint="reinstall vgpumgr; xml_templates/ ships inside the package") from exc


def template(name: str) -> etree._Element:
    """A fresh copy of a parsed template (the parsed original is cached)."""
    return copy.deepcopy(_template_tree(name))


def _on_off(value: bool | None) -> str | None:
    return None if value is None else ("on" if value else "off")


class XmlProp:
    """An attribute (or the text, when attr is None) of the element at `path` below a device's root.

    Setting None removes the attribute; missing elements on the path are created."""

    def __init__(self, path: str, attr: str | None = None, to_xml: Callable[[Any], str | None] = str,
                 from_xml: Callable[[str], Any] = str) -> None:
        self.path, self.attr, self.to_xml, self.from_xml = path, attr, to_xml, from_xml

    def _find(self, root: etree._Element, create: bool) -> etree._Element | None:
        el = root
        for part in [] if self.path == "." else self.path.split("/"):
            child = el.find(part)
            if child is None:
                if not create:
                    return None
                child = etree.SubElement(el, part)
            el = child
        return el

    def __get__(self, obj: XmlDevice | None, owner: type) -> Any:
        if obj is None:
            return self
        el = self._find(obj.element, create=False)
        raw = None if el is None else (el.text if self.attr is None else el.get(self.attr))
        return None if raw is None else self.from_xml(raw)

    def __set__(self, obj: XmlDevice, value: Any) -> None:
        text = None if value is None else self.to_xml(value)
        el = self._find(obj.element, create=text is not None)
        if el is None:
            return
        try:
            if self.attr is None:
                el.text = text
            elif text is None:
                el.attrib.pop(self.attr, None)
            else:
                el.set(self.attr, text)
        except ValueError as exc:  # lxml refuses NUL and other characters XML cannot hold
            raise InvalidInput(f"value {value!r} cannot be stored in XML: {exc}",
                               hint="remove control characters from the value") from exc


class XmlDevice:
    TEMPLATE: ClassVar[str]

    def __init__(self, element: etree._Element | None = None) -> None:
        self.element = element if element is not None else template(self.TEMPLATE)


class PciHostdev(XmlDevice):
    """`<hostdev type='pci'>`: a whole GPU (managed) or an NVIDIA vendor-specific VF (unmanaged)."""

    TEMPLATE = "hostdev-pci.xml"
    managed = XmlProp(".", "managed", lambda v: "yes" if v else "no", lambda s: s == "yes")
    domain = XmlProp("source/address", "domain", lambda v: f"0x{v:04x}", lambda s: int(s, 0))
    bus = XmlProp("source/address", "bus", lambda v: f"0x{v:02x}", lambda s: int(s, 0))
    slot = XmlProp("source/address", "slot", lambda v: f"0x{v:02x}", lambda s: int(s, 0))
    function = XmlProp("source/address", "function", lambda v: f"0x{v:x}", lambda s: int(s, 0))

    @property
    def address(self) -> str:
        return f"{self.domain or 0:04x}:{self.bus or 0:02x}:{self.slot or 0:02x}.{self.function or 0:x}"

    @address.setter
    def address(self, text: str) -> None:
        canonical = ids.pci_address(text)
        dom, bus, rest = canonical.split(":")
        slot, fn = rest.split(".")
        self.domain, self.bus = int(dom, 16), int(bus, 16)
        self.slot, self.function = int(slot, 16), int(fn, 16)


class MdevHostdev(XmlDevice):
    """`<hostdev type='mdev'>`: an mdev vGPU (NVIDIA GRID, MIG-backed on the mdev stack, Intel GVT-g)."""

    TEMPLATE = "hostdev-mdev.xml"
    uuid = XmlProp("source/address", "uuid", ids.mdev_uuid)
    model = XmlProp(".", "model")
    display = XmlProp(".", "display", _on_off, lambda s: s == "on")
    ramfb = XmlProp(".", "ramfb", _on_off, lambda s: s == "on")


class Disk(XmlDevice):
    TEMPLATE = "disk.xml"
    path = XmlProp("source", "file")
    format = XmlProp("driver", "type")
    target = XmlProp("target", "dev")


class NetworkInterface(XmlDevice):
    TEMPLATE = "interface-network.xml"
    network = XmlProp("source", "network")


class BridgeInterface(XmlDevice):
    TEMPLATE = "interface-bridge.xml"
    bridge = XmlProp("source", "bridge")


class VncGraphics(XmlDevice):
    TEMPLATE = "graphics-vnc.xml"
    listen = XmlProp("listen", "address")


class NoVideo(XmlDevice):
    TEMPLATE = "video-none.xml"


class Domain(XmlDevice):
    TEMPLATE = "domain.xml"
    name = XmlProp("name")
    uuid = XmlProp("uuid")
    memory_mib = XmlProp("memory", None, str, int)
    vcpus = XmlProp("vcpu", None, str, int)
    firmware = XmlProp("os", "firmware")  # libvirt picks the firmware file: "efi" or absent for BIOS

    def add_device(self, device: XmlDevice) -> None:
        self.element.find("devices").append(device.element)

    def set_allocations(self, allocations: list[dict[str, Any]]) -> None:
        meta = self.element.find("metadata")
        for old in meta.findall(f"{{{NS}}}vm"):
            meta.remove(old)
        if not allocations:
            return
        root = template("metadata.xml")
        for record in allocations:
            root.append(_allocation_element(record))
        meta.append(root)


# -- allocation records in <metadata> ---------------------------------------------------------------
def _allocation_element(record: dict[str, Any]) -> etree._Element:
    """One record as <vgpumgr:allocation><vgpumgr:field name=... type=...>value</...>: exact round trip."""
    if not isinstance(record, dict):
        raise InvalidInput(f"allocation record {record!r} is not a mapping", hint="pass dicts")
    el = etree.Element(f"{{{NS}}}allocation", nsmap={NS_PREFIX: NS})
    for key, value in record.items():
        if not isinstance(key, str) or not key:
            raise InvalidInput(f"allocation field name {key!r} is not a non-empty string",
                               hint="use string keys in allocation records")
        f = etree.SubElement(el, f"{{{NS}}}field", name=key)
        try:
            if isinstance(value, bool):
                f.set("type", "bool")
                f.text = "true" if value else "false"
            elif isinstance(value, int):
                f.set("type", "int")
                f.text = str(value)
            elif isinstance(value, float):
                f.set("type", "float")
                f.text = repr(value)
            elif value is None:
                f.set("type", "null")
            elif isinstance(value, str):
                f.text = value
            else:
                f.set("type", "json")
                f.text = json.dumps(value, sort_keys=True)
        except (ValueError, TypeError) as exc:  # lxml refuses control characters, json odd objects
            raise InvalidInput(f"allocation field {key!r} cannot be stored in XML: {exc}",
                               hint="use plain strings, numbers, booleans, lists or dicts") from exc
    return el


def _field_value(f: etree._Element) -> Any:
    text, kind = f.text or "", f.get("type", "str")
    if kind == "bool":
        return text == "true"
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    if kind == "null":
        return None
    if kind == "json":
        return json.loads(text)
    return text


def read_allocations(xml: str) -> list[dict[str, Any]]:
    """The vgpumgr allocation records stored in a domain's <metadata> (empty when there are none)."""
    root = parse_xml(xml)
    records = []
    for alloc in root.iterfind(f"metadata/{{{NS}}}vm/{{{NS}}}allocation"):
        records.append({f.get("name"): _field_value(f) for f in alloc.iterfind(f"{{{NS}}}field")})
    return records


# -- spec validation ----------------------------------------------------------------------------------
def _check_int(label: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidInput(f"{label} {value!r} is not a whole number from {low} to {high}",
                           hint=f"give {label} as an integer in that range")
    return value


def check_disk_path(path: str) -> tuple[str, str]:
    """(absolute path, format) of a disk image, or InvalidInput."""
    if not isinstance(path, str) or not path:
        raise InvalidInput("the disk path is empty", hint="give the absolute path of a qcow2 or raw image")
    if _CONTROL.search(path):
        raise InvalidInput(f"disk path {path!r} contains NUL, newline or other control characters",
                           hint="rename the image to a plain path")
    p = PurePosixPath(path)
    if not p.is_absolute():
        raise InvalidInput(f"disk path '{path}' is relative",
                           hint="give an absolute path such as /var/lib/libvirt/images/vm1.qcow2")
    if ".." in p.parts:
        raise InvalidInput(f"disk path '{path}' contains '..'", hint="give the resolved absolute path")
    return str(p), ("qcow2" if p.suffix.lower() == ".qcow2" else "raw")


def _network_device(network: str) -> XmlDevice:
    kind, _, value = network.partition(":") if ":" in network else ("network", "", network)
    if kind == "bridge":
        if not _BRIDGE_NAME.match(value):
            raise InvalidInput(f"'{value}' is not a bridge interface name",
                               hint="use bridge:NAME, 1-15 letters, digits, '.', '_' or '-', e.g. bridge:br0")
        dev = BridgeInterface()
        dev.bridge = value
        return dev
    if kind == "network" and _NETWORK_NAME.match(value):
        dev = NetworkInterface()
        dev.network = value
        return dev
    raise InvalidInput(f"'{network}' is not a network",
                       hint="use a libvirt network name such as 'default', or bridge:br0 for a host bridge")


def _check_hostdev(h: Hostdev) -> Hostdev:
    if not isinstance(h, Hostdev):
        raise InvalidInput(f"{h!r} is not a Hostdev", hint="pass vgpumgr.virt.domain.Hostdev objects")
    if h.kind not in HOSTDEV_KINDS:
        raise InvalidInput(f"'{h.kind}' is not a GPU device kind",
                           hint=f"use one of {', '.join(HOSTDEV_KINDS)}")
    if h.kind == "mdev":
        if h.uuid is None or h.address is not None:
            raise InvalidInput("an mdev device needs its UUID and no PCI address",
                               hint="give the mdev UUID (`vgpumgr vgpu list` shows it)")
        return Hostdev("mdev", uuid=ids.mdev_uuid(h.uuid), display=bool(h.display))
    if h.address is None or h.uuid is not None:
        raise InvalidInput(f"a {h.kind} device needs its PCI address and no UUID",
                           hint="give the address such as 0000:3b:00.0 (`vgpumgr gpus` lists them)")
    if h.display:
        raise InvalidInput(f"display is only available for mdev devices, not {h.kind}",
                           hint="drop the display option, or use an mdev vGPU for a console display")
    return Hostdev(h.kind, address=ids.pci_address(h.address))


def _device_key(h: Hostdev) -> str:
    return f"mdev:{h.uuid}" if h.kind == "mdev" else f"pci:{h.address}"


def _checked_spec(spec: VmSpec) -> VmSpec:
    hostdevs = [_check_hostdev(h) for h in spec.hostdevs]
    seen: set[str] = set()
    for h in hostdevs:
        key = _device_key(h)
        if key in seen:
            raise InvalidInput(f"device {key.split(':', 1)[1]} is given twice",
                               hint="list every GPU device of a VM once")
        seen.add(key)
    if spec.firmware not in FIRMWARES:
        raise InvalidInput(f"'{spec.firmware}' is not a firmware", hint="use bios or uefi")
    if not isinstance(spec.allocations, list):
        raise InvalidInput("allocations must be a list of records", hint="pass a list of dicts")
    if spec.domain_type not in DOMAIN_TYPES:
        raise InvalidInput(f"'{spec.domain_type}' is not a domain type",
                           hint="use kvm (hardware virtualisation) or qemu (software emulation)")
    return VmSpec(
        name=ids.vm_name(spec.name),
        uuid=ids.mdev_uuid(spec.uuid) if spec.uuid is not None else ids.new_uuid(),
        memory_mib=_check_int("memory (MiB)", spec.memory_mib, 64, MAX_MEMORY_MIB),
        vcpus=_check_int("vcpus", spec.vcpus, 1, MAX_VCPUS),
        firmware=spec.firmware,
        disk=check_disk_path(spec.disk)[0] if spec.disk is not None else None,
        network=spec.network,
        hostdevs=hostdevs,
        allocations=spec.allocations,
        domain_type=spec.domain_type,
        fwcfg=[check_fwcfg_entry(n, f) for n, f in spec.fwcfg],
    )


# -- fw_cfg items (<sysinfo type='fwcfg'>, libvirt >= 6.5.0; QEMU's -fw_cfg name=...,file=...) ------------
FWCFG_MAX_NAME = 55  # FW_CFG_MAX_FILE_PATH is 56 with the terminating NUL (linux uapi qemu_fw_cfg.h)
_FWCFG_NAME = re.compile(r"^opt/[\x21-\x7e]+$")
FWCFG_OURS = "opt/dev.vgpumgr/"  # the items vgpumgr adds; a domain's other items are checked only for duplicates


def check_fwcfg_entry(name: str, path: str) -> tuple[str, str]:
    """(name, absolute file) of one fw_cfg item, or InvalidInput: the name begins with opt/ (QEMU reserves the
    rest), is printable ASCII without spaces and at most 55 characters."""
    if not isinstance(name, str) or not _FWCFG_NAME.match(name) or name.startswith(("opt/ovmf/", "opt/org.qemu/")):
        raise InvalidInput(f"fw_cfg name {name!r} is not usable",
                           hint="use opt/<reverse domain>/<name> in printable ASCII, e.g. opt/dev.vgpumgr/nls/...")
    if len(name) > FWCFG_MAX_NAME:
        raise InvalidInput(f"fw_cfg name {name!r} has {len(name)} characters; the guest kernel keeps {FWCFG_MAX_NAME}",
                           hint="shorten the name")
    return name, check_disk_path(path)[0]


def set_fwcfg(root: etree._Element, entries: list[tuple[str, str]], prefix: str) -> None:
    """Replace the fw_cfg items whose name starts with `prefix` by `entries` (others' items stay)."""
    sysinfo = root.find("sysinfo[@type='fwcfg']")
    if sysinfo is not None:
        for entry in sysinfo.findall("entry"):
            if (entry.get("name") or "").startswith(prefix):
                sysinfo.remove(entry)
    if entries and sysinfo is None:
        sysinfo = etree.Element("sysinfo", type="fwcfg")
        anchor = root.find("os")
        anchor.addprevious(sysinfo) if anchor is not None else root.append(sysinfo)
    for name, path in entries:
        etree.SubElement(sysinfo, "entry", name=name, file=path)
    if sysinfo is not None and not len(sysinfo):
        root.remove(sysinfo)


def fwcfg_entries(xml: str) -> list[tuple[str, str | None]]:
    """(name, file or None for an inline value) of every fw_cfg item a domain XML gives its guest."""
    return [(e.get("name") or "", e.get("file")) for e in parse_xml(xml).iterfind("sysinfo[@type='fwcfg']/entry")]


def with_fwcfg(xml: str, entries: list[tuple[str, str]], prefix: str) -> str:
    """The domain XML with its fw_cfg items under `prefix` replaced by `entries` (checked)."""
    root = parse_xml(xml)
    set_fwcfg(root, [check_fwcfg_entry(n, f) for n, f in entries], prefix)
    return _to_string(root)


# -- rendering ----------------------------------------------------------------------------------------
def _hostdev_device(h: Hostdev, ramfb: bool) -> XmlDevice:
    if h.kind == "mdev":
        dev = MdevHostdev()
        dev.uuid = h.uuid
        if h.display:
            dev.display = True
            dev.ramfb = True if ramfb else None
        return dev
    pci = PciHostdev()
    pci.address = h.address
    # NVIDIA's vendor-specific VFs stay bound to nvidia.ko: libvirt must not rebind them to vfio-pci
    pci.managed = h.kind == "passthrough"
    return pci


def _to_string(el: etree._Element) -> str:
    return etree.tostring(el, pretty_print=True, encoding="unicode")


def build(spec: VmSpec) -> Domain:
    """The domain tree for a spec (checked, not yet schema-validated)."""
    s = _checked_spec(spec)
    dom = Domain()
    dom.name, dom.uuid, dom.memory_mib, dom.vcpus = s.name, s.uuid, s.memory_mib, s.vcpus
    dom.firmware = "efi" if s.firmware == "uefi" else None
    if s.domain_type == "qemu":
        dom.element.set("type", "qemu")
        cpu = dom.element.find("cpu")
        dom.element.remove(cpu)  # host-passthrough needs KVM; TCG uses QEMU's default CPU model
    dom.set_allocations(s.allocations)
    if s.disk is not None:
        disk = Disk()
        disk.path, disk.format = check_disk_path(s.disk)
        dom.add_device(disk)
    if s.network is not None:
        if not isinstance(s.network, str):
            raise InvalidInput(f"network {s.network!r} is not a string", hint="use 'default' or bridge:br0")
        dom.add_device(_network_device(s.network))
    displays = 0
    for h in s.hostdevs:
        # QEMU allows one ramfb: it goes on the first display device (it also makes that one non-hotpluggable)
        dom.add_device(_hostdev_device(h, ramfb=h.display and displays == 0))
        displays += h.display
    if displays:
        dom.add_device(VncGraphics())
        dom.add_device(NoVideo())
    if s.fwcfg:
        set_fwcfg(dom.element, s.fwcfg, "opt/")
    return dom


def render(spec: VmSpec, schema: bool = True) -> str:
    """Pretty domain XML for a spec, validated; InvalidInput with a readable message otherwise.
    `schema=False` skips only the RelaxNG check against libvirt's domain.rng (compiling it is most of the
    cost): for a dry run that defines nothing; what is about to be defined is always checked."""
    xml = _to_string(build(spec).element)
    validate(xml, schema=schema)
    return xml


def hostdev_xml(h: Hostdev) -> str:
    """A single <hostdev> element for attach/detach (no ramfb: a ramfb device cannot be hot-plugged)."""
    return _to_string(_hostdev_device(_check_hostdev(h), ramfb=False).element)


# -- validation -----------------------------------------------------------------------------------------
def parse_xml(xml: str | bytes) -> etree._Element:
    """Parse untrusted XML safely (no entities, no network); InvalidInput when it is not well-formed."""
    try:
        data = xml.encode() if isinstance(xml, str) else xml
        return etree.fromstring(data, etree.XMLParser(resolve_entities=False, no_network=True))
    except etree.XMLSyntaxError as exc:
        raise InvalidInput(f"the domain XML is not well-formed: {exc}", hint="check the XML") from exc


@functools.cache
def _domain_rng() -> etree.RelaxNG:
    try:
        return etree.RelaxNG(etree.parse(str(DOMAIN_RNG)))
    except (OSError, etree.RelaxNGParseError, etree.XMLSyntaxError) as exc:
        raise InvalidInput(f"libvirt's domain schema {DOMAIN_RNG} cannot be loaded: {exc}",
                           hint="install libvirt0 (it ships the schemas) or set VGPUMGR_DOMAIN_RNG") from exc


def _semantic_problems(root: etree._Element) -> list[str]:
    """Readable checks that the schema reports only as 'Extra element devices in interleave'."""
    problems: list[str] = []
    if root.tag != "domain":
        return [f"the root element is <{root.tag}>, not <domain>"]
    if not (root.findtext("name") or "").strip():
        problems.append("the domain has no <name>")
    hostdevs = root.findall("devices/hostdev")
    seen: set[str] = set()
    ramfbs = 0
    for i, hd in enumerate(hostdevs, 1):
        kind = hd.get("type")
        where = f"hostdev #{i} (type {kind!r})"
        if kind == "mdev":
            if hd.get("model") not in MDEV_MODELS:
                problems.append(f"{where} needs model= one of {', '.join(MDEV_MODELS)}")
            uuid = hd.find("source/address")
            try:
                key = "mdev " + ids.mdev_uuid(uuid.get("uuid", "") if uuid is not None else "")
            except InvalidInput:
                problems.append(f"{where} needs <source><address uuid='...'/> with a valid UUID")
                continue
            ramfbs += hd.get("ramfb") == "on"
            if hd.get("display") == "on" and root.find("devices/graphics") is None:
                problems.append(f"{where} has display='on' but the domain has no <graphics> device")
        elif kind == "pci":
            addr = hd.find("source/address")
            try:
                key = "pci " + _pci_from_attrs(addr)
            except (InvalidInput, ValueError, TypeError):
                problems.append(f"{where} needs <source><address domain= bus= slot= function=/> in range")
                continue
        else:
            continue
        if key in seen:
            problems.append(f"{where}: {key} is assigned twice")
        seen.add(key)
    if ramfbs > 1:
        problems.append("only one vGPU may have ramfb='on'")
    names: set[str] = set()
    for entry in root.iterfind("sysinfo[@type='fwcfg']/entry"):
        name = entry.get("name") or ""
        if name.startswith(FWCFG_OURS):  # others' items (e.g. opt/ovmf/X-PciMmio64Mb) are theirs to name
            try:
                check_fwcfg_entry(name, entry.get("file") or "/inline")
            except InvalidInput as e:
                problems.append(e.message)
        if name in names:
            problems.append(f"fw_cfg item {name} is given twice")
        names.add(name)
    return problems


def validate(xml: str, schema: bool = True) -> None:
    """Semantic checks (readable messages), then RelaxNG against libvirt's domain.rng (compiled once per
    process; `schema=False` leaves that out)."""
    root = parse_xml(xml)
    problems = _semantic_problems(root)
    if problems:
        raise InvalidInput("the domain XML is not usable: " + "; ".join(problems),
                           hint="fix the VM spec; `vgpumgr vm create --print-xml` shows the XML")
    if not schema:
        return
    rng = _domain_rng()
    if not rng.validate(etree.ElementTree(root)):
        errors = [f"line {e.line}: {e.message}" for e in rng.error_log][:5]
        raise InvalidInput("the domain XML does not validate against domain.rng: " + "; ".join(errors),
                           hint="this is a bug in vgpumgr's XML templates or a hand edit; "
                                "run `virt-xml-validate FILE domain` for details")


# -- what a domain uses ---------------------------------------------------------------------------------
def _pci_from_attrs(addr: etree._Element | None) -> str:
    if addr is None:
        raise InvalidInput("no address", hint="")
    dom, bus, slot, fn = (int(addr.get(k, "0"), 0) for k in ("domain", "bus", "slot", "function"))
    if not (0 <= dom <= 0xFFFF and 0 <= bus <= 0xFF and 0 <= slot <= 0x1F and 0 <= fn <= 7):
        raise InvalidInput("PCI address out of range", hint="")
    return f"{dom:04x}:{bus:02x}:{slot:02x}.{fn:x}"


def referenced_devices(xml: str) -> dict[str, list[str]]:
    """{"mdev": [uuids], "pci": [addresses]} a domain XML assigns (hostdevs and SR-IOV NIC VFs)."""
    root = parse_xml(xml)
    found: dict[str, list[str]] = {"mdev": [], "pci": []}
    for hd in root.iterfind("devices/hostdev"):
        addr = hd.find("source/address")
        try:
            if hd.get("type") == "mdev" and addr is not None:
                found["mdev"].append(ids.mdev_uuid(addr.get("uuid", "")))
            elif hd.get("type") == "pci":
                found["pci"].append(_pci_from_attrs(addr))
        except (InvalidInput, ValueError):
            continue  # a malformed address in someone else's domain is not ours to judge
    for iface in root.iterfind("devices/interface[@type='hostdev']"):
        try:
            found["pci"].append(_pci_from_attrs(iface.find("source/address")))
        except (InvalidInput, ValueError):
            continue
    return {k: list(dict.fromkeys(v)) for k, v in found.items()}
