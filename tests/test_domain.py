"""Domain XML: golden files per device kind, schema validation, escaping and refusal of odd input.

VGPUMGR_UPDATE_GOLDEN=1 rewrites tests/golden/xml/ from the current renderer (review the diff!).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lxml import etree

from vgpumgr.errors import InvalidInput
from vgpumgr.virt import domain
from vgpumgr.virt.domain import Hostdev, VmSpec

GOLDEN = Path(__file__).parent / "golden" / "xml"
VM_UUID = "5f0c2e1a-3b4d-4c5e-8f60-718293a4b5c6"
MDEV_A = "02cf755c-dcc5-5620-af1c-67549994f1ab"
MDEV_B = "8f7c3c52-1d6e-4a3c-9f1e-2b0d7d5a9c10"


def spec(name: str, hostdevs: list[Hostdev], **kw: object) -> VmSpec:
    return VmSpec(name=name, uuid=VM_UUID, hostdevs=hostdevs, **kw)  # type: ignore[arg-type]


# One spec per device kind the issue names; the golden file is the reviewed expected XML.
CASES: dict[str, VmSpec] = {
    "passthrough": spec("gpu-pt", [Hostdev("passthrough", address="0000:3b:00.0")]),
    "mdev": spec("vgpu-t4", [Hostdev("mdev", uuid=MDEV_A)]),
    "mdev-display": spec("vgpu-desktop", [Hostdev("mdev", uuid=MDEV_A, display=True)]),
    "nvidia-vf": spec("vgpu-l40s", [Hostdev("nvidia-vf", address="0000:3d:00.4")]),
    # MIG-backed vGPUs use whichever backend the GPU has: mdev on A100/A30, a vendor VF on Hopper
    "mig-mdev": spec("mig-a100", [Hostdev("mdev", uuid=MDEV_B)],
                     allocations=[{"backend": "mdev", "type": "nvidia-699", "name": "GRID A100-1-5C",
                                   "gpu": "0000:81:00.0", "parent": "0000:81:00.4", "uuid": MDEV_B,
                                   "mig": {"gi": 1, "profile": "1g.5gb"}}]),
    "mig-nvidia-vf": spec("mig-h100", [Hostdev("nvidia-vf", address="0000:ca:00.5")],
                          allocations=[{"backend": "nvidia-vf", "type": "nvidia-1148",
                                        "name": "NVIDIA H100XM-1-10C", "gpu": "0000:ca:00.0",
                                        "vf": "0000:ca:00.5"}]),
    "gvtg-display": spec("gvtg", [Hostdev("mdev", uuid=MDEV_A, display=True)], memory_mib=2048),
    "multi-gpu": spec("multi", [Hostdev("mdev", uuid=MDEV_A, display=True),
                                Hostdev("mdev", uuid=MDEV_B, display=True),
                                Hostdev("passthrough", address="3b:00.0")]),
    "full": spec("web1", [Hostdev("mdev", uuid=MDEV_A)], memory_mib=8192, vcpus=4, firmware="uefi",
                 disk="/var/lib/libvirt/images/web1.qcow2", network="bridge:br0",
                 allocations=[{"id": 7, "backend": "mdev", "type": "nvidia-232", "name": "GRID T4-4Q",
                               "gpu": "0000:3b:00.0", "uuid": MDEV_A, "state": "active", "seat": None,
                               "shared": False, "weight": 0.5}]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_xml(case: str) -> None:
    xml = domain.render(CASES[case])
    path = GOLDEN / f"{case}.xml"
    if os.environ.get("VGPUMGR_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(xml)
    assert path.is_file(), f"no golden file {path}; run with VGPUMGR_UPDATE_GOLDEN=1 and review it"
    assert xml == path.read_text()


def test_every_golden_file_validates_against_domain_rng() -> None:
    files = sorted(GOLDEN.glob("*.xml"))
    assert {f.stem for f in files} == set(CASES)
    rng = etree.RelaxNG(etree.parse("/usr/share/libvirt/schemas/domain.rng"))
    for f in files:
        assert rng.validate(etree.parse(str(f))), (f.name, rng.error_log)


def _hostdevs(xml: str) -> list[etree._Element]:
    return etree.fromstring(xml.encode()).findall("devices/hostdev")


def test_device_kinds_map_to_libvirt_attributes() -> None:
    (pt,) = _hostdevs(domain.render(CASES["passthrough"]))
    assert (pt.get("type"), pt.get("managed")) == ("pci", "yes")
    (vf,) = _hostdevs(domain.render(CASES["nvidia-vf"]))
    assert (vf.get("type"), vf.get("managed")) == ("pci", "no")  # the VF stays on nvidia.ko
    addr = vf.find("source/address")
    assert [addr.get(k) for k in ("domain", "bus", "slot", "function")] == ["0x0000", "0x3d", "0x00", "0x4"]
    (md,) = _hostdevs(domain.render(CASES["mdev"]))
    assert [md.get(k) for k in ("type", "model", "display", "ramfb")] == ["mdev", "vfio-pci", None, None]
    assert md.find("source/address").get("uuid") == MDEV_A


def test_display_adds_vnc_and_no_video_and_ramfb_only_on_first() -> None:
    root = etree.fromstring(domain.render(CASES["multi-gpu"]).encode())
    mdevs = root.findall("devices/hostdev[@type='mdev']")
    assert [(h.get("display"), h.get("ramfb")) for h in mdevs] == [("on", "on"), ("on", None)]
    assert root.find("devices/graphics").get("type") == "vnc"
    assert root.find("devices/video/model").get("type") == "none"
    headless = etree.fromstring(domain.render(CASES["mdev"]).encode())
    assert headless.find("devices/graphics") is None and headless.find("devices/video") is None


def test_domain_fields() -> None:
    root = etree.fromstring(domain.render(CASES["full"]).encode())
    assert root.findtext("name") == "web1" and root.findtext("uuid") == VM_UUID
    assert root.find("memory").get("unit") == "MiB"
    assert (root.findtext("memory"), root.findtext("vcpu")) == ("8192", "4")
    assert root.find("os").get("firmware") == "efi"
    assert root.find("os/type").get("machine") == "q35"
    assert root.find("devices/disk/source").get("file") == "/var/lib/libvirt/images/web1.qcow2"
    assert root.find("devices/disk/driver").get("type") == "qcow2"
    assert root.find("devices/interface").get("type") == "bridge"
    assert root.find("devices/interface/source").get("bridge") == "br0"
    bios = etree.fromstring(domain.render(CASES["mdev"]).encode())
    assert bios.find("os").get("firmware") is None


def test_network_by_name_and_raw_disk() -> None:
    root = etree.fromstring(domain.render(VmSpec("n1", network="default", disk="/srv/n1.img")).encode())
    assert root.find("devices/interface").get("type") == "network"
    assert root.find("devices/interface/source").get("network") == "default"
    assert root.find("devices/disk/driver").get("type") == "raw"


def test_uuid_generated_when_absent() -> None:
    a = etree.fromstring(domain.render(VmSpec("a")).encode()).findtext("uuid")
    b = etree.fromstring(domain.render(VmSpec("a")).encode()).findtext("uuid")
    assert a != b and len(a) == 36


def test_allocations_round_trip_exactly() -> None:
    records = CASES["full"].allocations + [{"note": "</vgpumgr:vm><evil/>&amp;", "list": [1, {"a": "b"}]}]
    xml = domain.render(VmSpec("meta", allocations=records))
    assert domain.read_allocations(xml) == records
    meta = etree.fromstring(xml.encode()).find("metadata")
    (vm,) = list(meta)
    assert vm.tag == f"{{{domain.NS}}}vm" and vm.prefix == "vgpumgr"
    assert domain.read_allocations(domain.render(VmSpec("empty"))) == []


# -- escaping and injection -------------------------------------------------------------------------------
def test_path_with_markup_is_escaped_not_interpreted() -> None:
    nasty = "/images/a'b\"c<d>&e/'/><hostdev type='pci'/>.qcow2"
    plain = etree.fromstring(domain.render(VmSpec("x", disk="/images/plain.qcow2")).encode())
    root = etree.fromstring(domain.render(VmSpec("x", disk=nasty)).encode())
    assert root.find("devices/disk/source").get("file") == nasty
    assert [e.tag for e in root.iter()] == [e.tag for e in plain.iter()]  # structure unchanged
    assert root.find("devices/hostdev") is None


@pytest.mark.parametrize("name", ["a<b", "a&b", "x'y", 'x"y', "vm</name><uuid>", "a b", "", "-lead", "a/b"])
def test_odd_vm_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidInput):
        domain.render(VmSpec(name))


@pytest.mark.parametrize("disk", ["images/x.qcow2", "x.qcow2", "/a/\x00b", "/a/b\nc", "/a/../etc/shadow",
                                  "/a/\tb", ""])
def test_bad_disk_paths_are_refused(disk: str) -> None:
    with pytest.raises(InvalidInput):
        domain.render(VmSpec("vm", disk=disk))


@pytest.mark.parametrize("network", ["bridge:br0'/><x", "bridge:", "bridge:waytoolongbridgename", "net work",
                                     "default'", "macvtap:eth0", ""])
def test_bad_networks_are_refused(network: str) -> None:
    with pytest.raises(InvalidInput):
        domain.render(VmSpec("vm", network=network))


@pytest.mark.parametrize("hostdev", [
    Hostdev("vfio", address="0000:3b:00.0"),
    Hostdev("mdev"),
    Hostdev("mdev", uuid="not-a-uuid"),
    Hostdev("mdev", uuid=MDEV_A, address="0000:3b:00.0"),
    Hostdev("passthrough"),
    Hostdev("passthrough", address="0000:3b:00.0'/>"),
    Hostdev("passthrough", address="0000:3b:00.0", display=True),
    Hostdev("nvidia-vf", address="0000:3d:00.4", uuid=MDEV_A),
])
def test_bad_hostdevs_are_refused(hostdev: Hostdev) -> None:
    with pytest.raises(InvalidInput):
        domain.render(VmSpec("vm", hostdevs=[hostdev]))


@pytest.mark.parametrize("field,value", [("memory_mib", 0), ("memory_mib", True), ("memory_mib", "4096"),
                                         ("vcpus", 0), ("vcpus", 10**6), ("firmware", "coreboot"),
                                         ("uuid", "1234")])
def test_bad_scalars_are_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidInput):
        domain.render(VmSpec("vm", **{field: value}))  # type: ignore[arg-type]


def test_same_device_twice_is_refused() -> None:
    with pytest.raises(InvalidInput, match="twice"):
        domain.render(VmSpec("vm", hostdevs=[Hostdev("passthrough", address="3b:00.0"),
                                             Hostdev("nvidia-vf", address="0000:3b:00.0")]))


def test_allocation_with_control_characters_is_refused() -> None:
    with pytest.raises(InvalidInput, match="allocation field"):
        domain.render(VmSpec("vm", allocations=[{"note": "a\x00b"}]))


# -- validate(): readable semantic errors first, the schema as backstop ------------------------------------
GOOD = domain.render(CASES["mdev-display"])


def _add_mdev(xml: str, uuid: str, extra: str) -> str:
    hostdev = (f'<hostdev mode="subsystem" type="mdev" model="vfio-pci"{extra}>'
               f'<source><address uuid="{uuid}"/></source></hostdev>')
    return xml.replace("</devices>", hostdev + "</devices>")


@pytest.mark.parametrize("edit,message", [
    (lambda x: x.replace(' model="vfio-pci"', ""), "needs model="),
    (lambda x: x.replace(f'uuid="{MDEV_A}"', 'uuid="zzz"'), "valid UUID"),
    (lambda x: x.split("<graphics")[0] + "<video>" + x.split("<video>")[1], "no <graphics>"),
    (lambda x: x.replace("<name>vgpu-desktop</name>", ""), "no <name>"),
    (lambda x: _add_mdev(x, MDEV_B, ' ramfb="on"'), "one vGPU may have ramfb"),
    (lambda x: _add_mdev(x, MDEV_A, ""), "assigned twice"),
    (lambda x: x.replace("<vcpu", "<vcpux").replace("</vcpu>", "</vcpux>"), "domain.rng"),
    (lambda x: x.replace("</domain>", ""), "not well-formed"),
])
def test_validate_explains_what_is_wrong(edit, message: str) -> None:  # type: ignore[no-untyped-def]
    domain.validate(GOOD)
    with pytest.raises(InvalidInput, match=message):
        domain.validate(edit(GOOD))


def test_validate_rejects_entities() -> None:
    evil = '<?xml version="1.0"?><!DOCTYPE d [<!ENTITY e SYSTEM "file:///etc/passwd">]>' \
           "<domain type='kvm'><name>&e;</name><memory>1</memory><os><type>hvm</type></os></domain>"
    with pytest.raises(InvalidInput):
        domain.validate(evil)


# -- single hostdev and what a domain references ------------------------------------------------------------
def test_hostdev_xml_for_attach() -> None:
    el = etree.fromstring(domain.hostdev_xml(Hostdev("mdev", uuid=MDEV_A.upper(), display=True)).encode())
    assert el.tag == "hostdev" and el.get("display") == "on" and el.get("ramfb") is None
    assert el.find("source/address").get("uuid") == MDEV_A
    vf = etree.fromstring(domain.hostdev_xml(Hostdev("nvidia-vf", address="3d:00.4")).encode())
    assert vf.get("managed") == "no" and vf.find("source/address").get("bus") == "0x3d"
    with pytest.raises(InvalidInput):
        domain.hostdev_xml(Hostdev("mdev", uuid="x"))


def test_referenced_devices_reads_hex_decimal_and_nic_vfs() -> None:
    xml = f"""<domain><devices>
      <hostdev type='mdev' model='vfio-pci'><source><address uuid='{MDEV_A.upper()}'/></source></hostdev>
      <hostdev type='pci' managed='yes'><source>
        <address domain='0' bus='59' slot='0' function='0'/></source></hostdev>
      <hostdev type='pci'><source><address bus='0x3d' slot='0x00' function='0x4'/></source></hostdev>
      <hostdev type='usb'><source><vendor id='0x1234'/></source></hostdev>
      <interface type='hostdev'><source><address type='pci' domain='0x0000' bus='0x5e' slot='0x10'
        function='0x2'/></source></interface>
    </devices></domain>"""
    assert domain.referenced_devices(xml) == {"mdev": [MDEV_A], "pci": ["0000:3b:00.0", "0000:3d:00.4",
                                                                         "0000:5e:10.2"]}
    assert domain.referenced_devices(domain.render(CASES["multi-gpu"])) == {
        "mdev": [MDEV_A, MDEV_B], "pci": ["0000:3b:00.0"]}


def test_xml_props_map_to_paths() -> None:
    dev = domain.PciHostdev()
    dev.address = "5e:10.2"
    assert dev.address == "0000:5e:10.2"
    assert dev.element.find("source/address").get("slot") == "0x10"
    m = domain.MdevHostdev()
    m.display = True
    assert m.display is True and m.element.get("display") == "on"
    m.display = None
    assert "display" not in m.element.attrib


def test_qemu_domain_type_for_hosts_without_kvm() -> None:
    render = domain.render
    xml = render(VmSpec(name="tcg", uuid="00000000-0000-4000-8000-000000000001", domain_type="qemu",
                        hostdevs=[Hostdev("mdev", uuid="00000000-0000-4000-8000-000000000002")]))
    assert '<domain type="qemu">' in xml and "<cpu" not in xml
    kvm = render(VmSpec(name="hw", hostdevs=[Hostdev("mdev", uuid="00000000-0000-4000-8000-000000000002")]))
    assert '<domain type="kvm">' in kvm and 'mode="host-passthrough"' in kvm
    with pytest.raises(InvalidInput, match="not a domain type"):
        render(VmSpec(name="x", domain_type="xen"))
