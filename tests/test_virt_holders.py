"""The libvirt holder check a release asks before removing a device: the running domains that use it.

It is asked once per release, so it keeps what it can: a real URI's connection stays open (and is opened
again when it dies), a saved test-driver host is parsed again only when a save changed it. What it answers
must not change: a domain another process defined and started is seen at the next check, and one it
stopped no longer is.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vgpumgr.virt import domain
from vgpumgr.virt import driver as virt
from vgpumgr.virt import holders as virt_holders
from vgpumgr.virt.domain import Hostdev, VmSpec
from vgpumgr.virt.driver import Virt
from vgpumgr.virt.holders import holder_check

MDEV_A = "02cf755c-dcc5-5620-af1c-67549994f1ab"
MDEV_B = "8f7c3c52-1d6e-4a3c-9f1e-2b0d7d5a9c10"
VF = "0000:3d:00.4"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def uri(tmp_path: Path) -> str:
    host = tmp_path / "testhost.xml"
    host.write_text("<node><cpu><mode>host-passthrough</mode></cpu></node>\n")
    return f"test://{host}"


def vm_xml(name: str, hostdevs: list[Hostdev]) -> str:
    return domain.render(VmSpec(name, hostdevs=hostdevs))


def in_other_process(uri: str, state: Path, code: str) -> None:
    """Run `code` with `v`, a Virt on the same saved test host, in a separate Python process."""
    prog = textwrap.dedent(f"""
        from vgpumgr.virt import domain
        from vgpumgr.virt.domain import Hostdev, VmSpec
        from vgpumgr.virt.driver import Virt
        with Virt({uri!r}, state_dir={str(state)!r}) as v:
        """) + textwrap.indent(textwrap.dedent(code), "    ")
    subprocess.run([sys.executable, "-c", prog], cwd=REPO, check=True, capture_output=True, text=True)


def count_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    libvirt = virt._libvirt()
    opened: list[str] = []
    real_open = libvirt.open

    def counting_open(u: str):  # noqa: ANN202
        opened.append(u)
        return real_open(u)

    monkeypatch.setattr(libvirt, "open", counting_open)
    return opened


def test_a_domain_another_process_starts_or_stops_is_seen_at_the_next_check(uri: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    mdev, pci = holder_check(uri, state, "mdev"), holder_check(uri, state, "pci")
    assert mdev(MDEV_A) == []  # nothing saved yet
    with Virt(uri, state_dir=state) as here:
        here.define(vm_xml("local", [Hostdev("mdev", uuid=MDEV_B)]))
        here.start("local")
    assert mdev(MDEV_B) == ["running libvirt domain local"]
    assert mdev(MDEV_A) == []
    in_other_process(uri, state, f"""
        v.define(domain.render(VmSpec("remote", hostdevs=[Hostdev("mdev", uuid={MDEV_A!r}),
                                                          Hostdev("nvidia-vf", address={VF!r})])))
        v.start("remote")
        """)
    assert mdev(MDEV_A.upper()) == ["running libvirt domain remote"]
    assert pci(VF) == ["running libvirt domain remote"]
    assert mdev(MDEV_B) == ["running libvirt domain local"]
    in_other_process(uri, state, 'v.stop("remote")')  # a stopped domain holds nothing in the kernel
    assert mdev(MDEV_A) == [] and pci(VF) == []
    in_other_process(uri, state, f"""
        v.start("remote")
        v.detach("remote", domain.hostdev_xml(Hostdev("mdev", uuid={MDEV_A!r})))
        """)  # only the domain's XML changes, not its name or state
    assert mdev(MDEV_A) == [] and pci(VF) == ["running libvirt domain remote"]


def test_a_saved_host_answers_as_a_fresh_connection_restored_from_it_would(uri: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    with Virt(uri, state_dir=state) as v:
        v.define(vm_xml("a", [Hostdev("mdev", uuid=MDEV_A), Hostdev("nvidia-vf", address=VF)]))
        v.define(vm_xml("b", [Hostdev("mdev", uuid=MDEV_A)]))
        v.define(vm_xml("c", [Hostdev("mdev", uuid=MDEV_B)]))
        v.start("a")
        v.start("b")
        v.start("c")
        v.conn.lookupByName("c").suspend()
        v.stop("a")
        v.start("a")
        v._save()  # the suspend went round Virt
    with Virt(uri, state_dir=state) as fresh:
        for kind, key in (("mdev", MDEV_A), ("mdev", MDEV_B), ("pci", VF), ("pci", "0000:3b:00.0")):
            names = fresh.domains_using_mdev(key) if kind == "mdev" else fresh.domains_using_pci(key)
            expected = [f"running libvirt domain {n}" for n in names if fresh.state(n) in ("running", "paused")]
            assert holder_check(uri, state, kind)(key) == expected
    assert holder_check(uri, state, "mdev")(MDEV_A) == ["running libvirt domain a", "running libvirt domain b"]
    assert holder_check(uri, state, "mdev")(MDEV_B) == ["running libvirt domain c"]  # paused holds it too
    assert holder_check(uri, state, "mdev")("not-a-uuid") == []


def test_a_saved_host_is_read_without_a_libvirt_connection_and_parsed_once_per_save(
        uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    with Virt(uri, state_dir=state) as v:
        v.define(vm_xml("a", [Hostdev("mdev", uuid=MDEV_A)]))
        v.start("a")
    opened = count_opens(monkeypatch)
    parsed: list[str] = []
    real_refs = domain.referenced_devices
    monkeypatch.setattr(virt_holders.domxml, "referenced_devices", lambda xml: parsed.append(xml) or real_refs(xml))
    check = holder_check(uri, state, "mdev")
    for _ in range(5):
        assert check(MDEV_A) == ["running libvirt domain a"]
    assert opened == [] and len(parsed) == 1


def running_at_boot(uri: str) -> None:
    """Make the test host file hold a domain 'boot' that runs from the start and uses MDEV_A."""
    host = Path(uri.removeprefix("test://"))
    host.write_text(f"<node><cpu><mode>host-passthrough</mode></cpu>{vm_xml('boot', [Hostdev('mdev', uuid=MDEV_A)])}"
                    "</node>\n")


def test_without_a_saved_host_a_fresh_connection_answers(uri: str, tmp_path: Path) -> None:
    running_at_boot(uri)
    assert holder_check(uri, None, "mdev")(MDEV_A) == ["running libvirt domain boot"]
    assert holder_check(uri, tmp_path / "empty-state", "mdev")(MDEV_A) == ["running libvirt domain boot"]


def test_a_live_connection_is_kept_across_checks_and_replaced_when_it_dies(
        uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with Virt(uri) as v:
        assert virt_holders._alive(v) is False and v._conn is None  # asking does not open a connection
    running_at_boot(uri)
    opened = count_opens(monkeypatch)
    live = virt_holders._LiveHolders(uri)  # what holder_check keeps for a real URI (qemu:///system)
    assert live("mdev", MDEV_A) == ["running libvirt domain boot"]
    assert live("pci", VF) == [] and live("mdev", MDEV_B) == []
    assert opened == [uri]
    live._virt.conn.close()  # libvirtd restarted: the next check gets a new connection and an answer
    assert live("mdev", MDEV_A) == ["running libvirt domain boot"]
    assert opened == [uri, uri]
    assert virt_holders._alive(live._virt)


def test_holder_check_keeps_one_live_checker_per_real_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(virt_holders, "_live_checks", {})
    holder_check("qemu:///nowhere", None, "mdev")
    holder_check("qemu:///nowhere", "/tmp/ignored", "pci")
    assert list(virt_holders._live_checks) == ["qemu:///nowhere"]
