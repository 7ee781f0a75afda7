"""Virt on libvirt's test driver: lifecycle, error mapping, device lookups, attach/detach, persistence.

Each test opens its own test-driver host file (`test:///<file>`): unlike test:///default, whose state is
shared by every connection of a process, a file URI gives every connection a fresh, private host.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from lxml import etree

from vgpumgr.errors import Busy, Conflict, InvalidInput, NotFound, Unavailable
from vgpumgr.virt import domain
from vgpumgr.virt.domain import Hostdev, VmSpec
from vgpumgr.virt.driver import Virt

GOLDEN = Path(__file__).parent / "golden" / "xml"
MDEV_A = "02cf755c-dcc5-5620-af1c-67549994f1ab"
MDEV_B = "8f7c3c52-1d6e-4a3c-9f1e-2b0d7d5a9c10"


@pytest.fixture
def uri(tmp_path: Path) -> str:
    host = tmp_path / "testhost.xml"
    host.write_text("<node><cpu><mode>host-passthrough</mode></cpu></node>\n")
    return f"test://{host}"


@pytest.fixture
def virt(uri: str) -> Virt:
    v = Virt(uri)
    yield v
    v.close()


def vm_xml(name: str, hostdevs: list[Hostdev] | None = None, **kw: object) -> str:
    return domain.render(VmSpec(name, hostdevs=hostdevs or [], **kw))  # type: ignore[arg-type]


def test_uri_from_argument_env_or_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VGPUMGR_LIBVIRT_URI", raising=False)
    assert Virt().uri == "qemu:///system"
    monkeypatch.setenv("VGPUMGR_LIBVIRT_URI", "test:///default")
    assert Virt().uri == "test:///default"
    assert Virt("qemu:///session").uri == "qemu:///session"


def test_module_import_does_not_load_libvirt() -> None:
    code = "import sys, vgpumgr.virt.driver; print('libvirt' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_lifecycle(virt: Virt) -> None:
    assert virt.list() == []
    assert virt.define(vm_xml("web1", [Hostdev("mdev", uuid=MDEV_A)])) == "web1"
    assert virt.exists("web1") and not virt.exists("web2")
    (row,) = virt.list()
    assert row["name"] == "web1" and row["state"] == "shutoff" and len(row["uuid"]) == 36
    virt.start("web1")
    assert virt.state("web1") == "running"
    virt.stop("web1")
    assert virt.state("web1") == "shutoff"
    virt.stop("web1")  # stopping a stopped VM does nothing
    virt.undefine("web1")
    assert virt.list() == [] and not virt.exists("web1")


def test_errors_become_vgpumgr_errors(virt: Virt) -> None:
    virt.define(vm_xml("a"))
    with pytest.raises(Conflict, match="already exists"):
        virt.define(vm_xml("a"))
    for call in (virt.start, virt.stop, virt.undefine, virt.xml):
        with pytest.raises(NotFound) as exc:
            call("missing")
        assert exc.value.hint
    virt.start("a")
    with pytest.raises(Conflict, match="already running"):
        virt.start("a")
    with pytest.raises(Busy, match="running"):
        virt.undefine("a")
    with pytest.raises(InvalidInput, match="domain.rng"):
        virt.define("<domain><name>bad</name></domain>")  # no type, no <os>, no <memory>
    no_model = ("<domain type='kvm'><name>nm</name><memory>1024</memory><os><type>hvm</type></os><devices>"
                f"<hostdev type='mdev'><source><address uuid='{MDEV_A}'/></source></hostdev>"
                "</devices></domain>")
    with pytest.raises(InvalidInput, match="model"):
        virt.define(no_model)
    with pytest.raises(InvalidInput, match="define VM 'nm'.*model"):  # libvirt's own refusal, mapped
        virt.define(no_model, validate=False)
    with pytest.raises(InvalidInput):
        virt.define("<domain>")


def test_replace_redefines_an_existing_name(virt: Virt) -> None:
    xml = vm_xml("r", memory_mib=1024)
    virt.define(xml)
    uuid = etree.fromstring(xml.encode()).findtext("uuid")
    virt.define(xml.replace(">1024<", ">2048<"), replace=True)
    root = etree.fromstring(virt.xml("r").encode())
    assert root.findtext("uuid") == uuid and root.findtext("memory") == str(2048 * 1024)


def test_unopenable_uri_is_unavailable_with_hint(tmp_path: Path) -> None:
    with pytest.raises(Unavailable) as exc:
        Virt(f"test://{tmp_path}/no-such-host.xml").list()
    assert "test:///default" in (exc.value.hint or "")


@pytest.mark.parametrize("golden", sorted(GOLDEN.glob("*.xml")), ids=lambda p: p.stem)
def test_every_golden_defines_starts_and_keeps_metadata(virt: Virt, golden: Path) -> None:
    xml = golden.read_text()
    name = virt.define(xml)
    virt.start(name)
    dumped = virt.xml(name)
    assert domain.read_allocations(dumped) == domain.read_allocations(xml)
    assert domain.referenced_devices(dumped) == domain.referenced_devices(xml)
    virt.stop(name)
    virt.undefine(name)


def test_domains_using_devices(virt: Virt) -> None:
    virt.define(vm_xml("m1", [Hostdev("mdev", uuid=MDEV_A), Hostdev("passthrough", address="3b:00.0")]))
    virt.define(vm_xml("m2", [Hostdev("mdev", uuid=MDEV_B)]))
    virt.start("m2")
    assert virt.domains_using_mdev(MDEV_A.upper()) == ["m1"]
    assert virt.domains_using_mdev(MDEV_B) == ["m2"]
    assert virt.domains_using_pci("0000:3b:00.0") == ["m1"]
    assert virt.domains_using_pci("0000:3d:00.4") == []
    with pytest.raises(InvalidInput):
        virt.domains_using_pci("3b:00")


def test_attach_and_detach_change_the_config(virt: Virt) -> None:
    virt.define(vm_xml("d"))
    vf = domain.hostdev_xml(Hostdev("nvidia-vf", address="0000:3d:00.4"))
    virt.attach("d", vf)
    assert virt.domains_using_pci("0000:3d:00.4") == ["d"]
    with pytest.raises(Conflict):
        virt.attach("d", vf)
    virt.attach("d", domain.hostdev_xml(Hostdev("mdev", uuid=MDEV_A)))
    virt.detach("d", vf)
    assert domain.referenced_devices(virt.xml("d")) == {"mdev": [MDEV_A], "pci": []}
    with pytest.raises(NotFound):
        virt.detach("d", vf)
    with pytest.raises(InvalidInput):
        virt.attach("d", "<hostdev type='usb'/>")


# -- persistence for test URIs -----------------------------------------------------------------------------
def test_without_state_dir_a_new_connection_sees_nothing(uri: str) -> None:
    with Virt(uri) as first:
        first.define(vm_xml("gone"))
    with Virt(uri) as second:
        assert second.list() == []


def test_state_dir_carries_domains_and_run_state_across_connections(uri: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    with Virt(uri, state_dir=state) as first:
        first.define(vm_xml("alpha", [Hostdev("mdev", uuid=MDEV_A)], allocations=[{"id": 1}]))
        first.define(vm_xml("beta"))
        first.start("alpha")
    assert (state / "libvirt-test" / "state.json").is_file()
    with Virt(uri, state_dir=state) as second:
        assert [(r["name"], r["state"]) for r in second.list()] == [("alpha", "running"), ("beta", "shutoff")]
        assert domain.read_allocations(second.xml("alpha")) == [{"id": 1}]
        assert second.domains_using_mdev(MDEV_A) == ["alpha"]
        second.stop("alpha")
        second.undefine("beta")
        second.attach("alpha", domain.hostdev_xml(Hostdev("mdev", uuid=MDEV_B)))
    with Virt(uri, state_dir=state) as third:
        assert [(r["name"], r["state"]) for r in third.list()] == [("alpha", "shutoff")]
        assert third.domains_using_mdev(MDEV_B) == ["alpha"]
    assert len(list((state / "libvirt-test").glob("*.xml"))) == 1


def test_state_dir_on_test_default_removes_what_the_snapshot_lacks(tmp_path: Path) -> None:
    # test:///default starts with a domain named "test"; once a snapshot exists it is the truth
    state = tmp_path / "state"
    with Virt("test:///default", state_dir=state) as first:
        names = [r["name"] for r in first.list()]
        if "test" in names:
            first.stop("test")
            first.undefine("test")
        first.define(vm_xml("persist-default"))
    with Virt("test:///default", state_dir=state) as second:
        assert "persist-default" in [r["name"] for r in second.list()]
        assert "test" not in [r["name"] for r in second.list()]
        second.undefine("persist-default")


def test_state_dir_is_ignored_for_real_uris(tmp_path: Path) -> None:
    assert Virt("qemu:///system", state_dir=tmp_path).state_path is None


class Killed(BaseException):
    """Stands in for SIGKILL: nothing after it runs, no handler catches it."""


@pytest.mark.parametrize("kill_at", ["state.json", "unlink"])
def test_a_save_killed_midway_leaves_a_state_the_next_connection_restores(
        uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill_at: str) -> None:
    from vgpumgr.virt import driver

    state = tmp_path / "state"
    with Virt(uri, state_dir=state) as first:
        first.define(vm_xml("old"))
        first.define(vm_xml("new"))
    real_write = driver._write_atomic

    def write(path: Path, text: str) -> None:
        if kill_at == "state.json" and path.name == "state.json":
            raise Killed
        real_write(path, text)

    def unlink(self: Path, missing_ok: bool = False) -> None:
        raise Killed

    monkeypatch.setattr(driver, "_write_atomic", write)
    if kill_at == "unlink":
        monkeypatch.setattr(Path, "unlink", unlink)
    with Virt(uri, state_dir=state) as second, pytest.raises(Killed):
        second.undefine("old")  # dies while saving
    monkeypatch.undo()
    with Virt(uri, state_dir=state) as third:
        # the save either happened (state.json written) or did not: never a state.json naming a removed file
        want = ["new"] if kill_at == "unlink" else ["new", "old"]
        assert sorted(r["name"] for r in third.list()) == want


def test_a_saved_state_naming_a_missing_file_is_a_clear_error(uri: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    with Virt(uri, state_dir=state) as first:
        first.define(vm_xml("alpha"))
    for saved in (state / "libvirt-test").glob("*.xml"):
        saved.unlink()
    with Virt(uri, state_dir=state) as second, pytest.raises(Unavailable) as exc:
        second.list()
    assert "cannot be read" in str(exc.value) and "remove" in exc.value.hint
