"""Licence token delivery on the simulator, as a user runs it: a token set once reaches a new Linux VM through fw_cfg
(its XML names the per-VM copy, the simulated guest boots, the shipped guest helper installs it, NVML then reports
licensed) and a Windows-like VM through the guest agent (`license deliver`), without touching either guest; a
guest that never licenses is named by `license check`; the token's bytes appear nowhere: not in the database
file, the audit trail, the logs, any REST answer, any web page or /metrics."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from lxml import etree
from simhost import run

from api import tokens
from api.app import create_app
from vgpumgr.config import Config
from vgpumgr.licensing import token as licence_token
from vgpumgr.service import Service
from vgpumgr.sim import guests, profiles
from vgpumgr.virt import domain

SERVER = "dls.example.test"
LINUX_DIR = "fs/etc/nvidia/ClientConfigToken"
WINDOWS_DIR = "fs/C/Program Files/NVIDIA Corporation/vGPU Licensing/ClientConfigToken"


def _b64(obj: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")


def make_token(exp: float | None = None, server: str = SERVER) -> bytes:
    """A client configuration token shaped like NLS's (an RS256 JWS; the signature is random here)."""
    now = int(time.time())
    claims = {"iss": "NLS Service Instance", "aud": "NLS Licensed Client", "iat": now,
              "exp": int(exp if exp is not None else now + 365 * 86400), "scope_ref_list": [secrets.token_hex(16)],
              "service_instance_configuration": {"node_url_list": [{"idx": 0, "url": server, "url_qr": server,
                                                                    "svc_port_set_idx": 0}]}}
    sig = base64.urlsafe_b64encode(secrets.token_bytes(256)).decode().rstrip("=")
    return f"{_b64({'alg': 'RS256', 'typ': 'JWT'})}.{_b64(claims)}.{sig}".encode()


class Host:
    def __init__(self, tmp_path: Path) -> None:
        self.root = profiles.create(tmp_path / "sim", "mixed", vfs=8)
        self.state = tmp_path / "state"
        self.cfg = Config.resolve(sysfs_root=str(self.root), state_dir=str(self.state), connect="test:///default")
        self.outputs: list[str] = []

    def cli(self, *argv: str, rc: int = 0) -> str:
        code, out, err = run("--sysfs-root", str(self.root), "--state-dir", str(self.state),
                             "--connect", "test:///default", *argv)
        self.outputs += [out, err]
        assert code == rc, (argv, code, out, err)
        return out

    def vm_uuid(self, vm: str) -> str:
        return next(d["uuid"] for d in Service(self.cfg).list_vms() if d["name"] == vm)

    def vgpu(self, vm: str) -> str:
        [a] = Service(self.cfg).allocations(vm=vm, live=True)
        return a["uuid"] or a["pci_address"]

    def guest(self, vm: str) -> Path:
        return self.state / "libvirt-test" / "guests" / self.vm_uuid(vm)

    def licence(self, vm: str) -> str:
        snap = json.loads(self.cli("top", "--json"))
        [row] = [r for r in snap["vgpus"] if r["vm"] == vm]
        return row["licence"]["state"]


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Host:
    monkeypatch.setenv("VGPUMGR_LICENCE_MODE", "warn")
    h = Host(tmp_path)
    h.cli("license", "add", "lab-vws", "--edition", "vWS", "--seats", "10")
    return h


def test_a_token_set_once_reaches_a_linux_vm_by_fwcfg_and_a_windows_vm_by_the_agent(
        lab: Host, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    token = make_token()
    (tmp_path / "nls.tok").write_bytes(token)
    out = lab.cli("license", "token", "set", str(tmp_path / "nls.tok"))
    fp = licence_token.fingerprint(token)
    assert fp in out and SERVER in out
    stored = lab.state / "licence-token" / "default.tok"
    assert stored.read_bytes() == token
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert stat.S_IMODE(stored.parent.stat().st_mode) == 0o700
    shown = json.loads(lab.cli("license", "token", "show", "--json"))
    assert [(t["fingerprint"], t["server"], t["expired"]) for t in shown] == [(fp, SERVER, False)]

    # Linux: the default delivery is fw_cfg; nothing is done inside the guest
    lab.cli("vm", "create", "lin", "--vgpu", "L40S-4Q", "--start")
    xml = lab.cli("vm", "xml", "lin")
    uuid = lab.vm_uuid("lin")
    copy = lab.state / "fwcfg" / f"{uuid}.tok"
    assert domain.fwcfg_entries(xml) == [("opt/dev.vgpumgr/nls/ft1/client_configuration_token", str(copy))]
    domain.validate(xml)  # libvirt's domain.rng
    assert copy.read_bytes() == token and stat.S_IMODE(copy.stat().st_mode) in (0o600, 0o640)
    lab.cli("sim", "guest", "start", lab.vgpu("lin"), "--os", "linux", "--licensing", "token")
    [installed] = (lab.guest("lin") / LINUX_DIR).glob("client_configuration_token_*.tok")
    assert installed.read_bytes() == token
    assert re.fullmatch(r"client_configuration_token_\d\d-\d\d-\d{4}-\d\d-\d\d-\d\d\.tok", installed.name)
    assert "FeatureType=1" in (lab.guest("lin") / "fs/etc/nvidia/gridd.conf").read_text().splitlines()
    assert lab.licence("lin") == "licensed"

    # Windows-like: fw_cfg cannot be read there, the guest agent writes the token and restarts the service
    lab.cli("vm", "create", "win", "--vgpu", "L40S-4Q", "--start", "--licence-delivery", "agent")
    assert domain.fwcfg_entries(lab.cli("vm", "xml", "win")) == []
    lab.cli("sim", "guest", "start", lab.vgpu("win"), "--os", "windows", "--licensing", "token")
    assert lab.licence("win") != "licensed"  # no token yet: it cannot license
    out = json.loads(lab.cli("license", "deliver", "win", "--json"))
    assert out["os"] == "windows" and out["service"] == "NVDisplay.ContainerLocalSystem" and out["fingerprint"] == fp
    [pushed] = (lab.guest("win") / WINDOWS_DIR).glob("client_configuration_token_*.tok")
    assert pushed.read_bytes() == token
    assert "restart NVDisplay.ContainerLocalSystem" in (lab.guest("win") / "services.log").read_text()
    assert lab.licence("win") == "licensed"

    deliveries = {r["vm"]: r for r in json.loads(lab.cli("license", "delivery", "--json"))}
    assert (deliveries["lin"]["mode"], deliveries["lin"]["method"]) == ("fwcfg", "fwcfg")
    assert (deliveries["win"]["mode"], deliveries["win"]["chosen_by"], deliveries["win"]["method"]) == \
        ("agent", "vm", "agent")
    assert deliveries["lin"]["first_licensed_at"] and deliveries["win"]["first_licensed_at"]
    assert json.loads(lab.cli("license", "check", "--json"))["findings"] == []

    # the token's bytes are nowhere but in the files meant for them
    svc = Service(lab.cfg)
    admin = tokens.create_token(lab.cfg, "admin", "admin")
    client = TestClient(create_app(lab.cfg, service=svc, watch=False))
    h = {"Authorization": f"Bearer {admin}"}
    answers = [client.get("/metrics", headers=h).text]
    for route in client.app.routes:
        path = getattr(route, "path", "")
        if "GET" in getattr(route, "methods", ()) and path.startswith("/v1/") and "{" not in path:
            answers.append(client.get(path, headers=h).text)
    answers.append(client.post("/v1/licences/check", headers=h).text)
    pushed = client.post("/v1/licences/deliver/win", headers=h)
    assert pushed.status_code == 200 and pushed.json()["fingerprint"] == fp
    answers.append(pushed.text)
    assert client.post("/v1/licences/deliver/nosuch", headers=h).status_code == 404
    listed = client.get("/v1/licences/deliveries", headers=h).json()
    assert [t["fingerprint"] for t in listed["tokens"]] == [fp] and {v["vm"] for v in listed["vms"]} == {"lin", "win"}
    page = client.get("/ui/login")
    csrf = re.search(r'name="csrf" value="([^"]*)"', page.text).group(1)
    client.post("/ui/login", data={"token": admin, "csrf": csrf, "next": "/ui/"}, follow_redirects=False)
    licences_page = client.get("/ui/licences").text
    assert 'data-vm="win" data-mode="agent"' in licences_page and fp in licences_page
    answers.append(licences_page)
    metrics = answers[0]
    assert re.search(r'vgpumgr_vm_licence_time_to_licensed_seconds\{vm="lin"\} \d', metrics)
    answers.append(lab.cli("audit", "list", "--json"))
    assert fp in answers[-1] and "licence.token.set" in answers[-1]
    export = tmp_path / "audit.jsonl"
    lab.cli("audit", "export", "--output", str(export))
    db_files = [p for p in lab.state.iterdir() if p.name.startswith("vgpumgr.db")]
    assert db_files
    haystacks = {"cli": "".join(lab.outputs).encode(), "api": "".join(answers).encode(),
                 "logs": "\n".join(r.getMessage() for r in caplog.records).encode(),
                 "audit export": export.read_bytes(), **{p.name: p.read_bytes() for p in db_files}}
    signature = token.split(b".")[2][:48]
    for where, data in haystacks.items():
        assert token not in data and signature not in data, f"the token leaked into {where}"

    # removed with the VM
    lab.cli("vm", "delete", "lin")
    assert not copy.exists()
    assert "lin" not in {r["vm"] for r in json.loads(lab.cli("license", "delivery", "--json"))}


def test_license_check_names_the_vm_whose_guest_did_not_license_after_delivery(
        lab: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = make_token()
    (tmp_path / "nls.tok").write_bytes(token)
    lab.cli("license", "token", "set", str(tmp_path / "nls.tok"))
    lab.cli("vm", "create", "good", "--vgpu", "L40S-4Q", "--start")
    lab.cli("vm", "create", "stuck", "--vgpu", "L40S-4Q", "--start")
    lab.cli("sim", "guest", "start", lab.vgpu("good"), "--os", "linux", "--licensing", "token")
    lab.cli("sim", "guest", "start", lab.vgpu("stuck"), "--os", "linux", "--licensing", "never")
    assert (lab.licence("good"), lab.licence("stuck")) == ("licensed", "unlicensed-unrestricted")
    assert json.loads(lab.cli("license", "check", "--json"))["findings"] == []  # within the grace period
    monkeypatch.setenv("VGPUMGR_LICENCE_DELIVERY_GRACE", "0")
    out = lab.cli("license", "check", rc=10)
    assert "delivered-still-unlicensed" in out and "stuck" in out and "good" not in out
    [f] = json.loads(lab.cli("license", "check", "--json", rc=10))["findings"]
    assert (f["kind"], f["vm"]) == ("delivered-still-unlicensed", "stuck")
    assert "ago; the guest still reports unlicensed-unrestricted" in f["evidence"]
    assert licence_token.fingerprint(token) in f["evidence"] and token.decode() not in json.dumps(f)


def test_token_not_delivered_expired_and_for_another_server(lab: Host, tmp_path: Path) -> None:
    (tmp_path / "old.tok").write_bytes(make_token(server="old-dls.example.test"))
    lab.cli("vm", "create", "early", "--vgpu", "L40S-4Q", "--start")  # before any token: no fw_cfg item
    assert domain.fwcfg_entries(lab.cli("vm", "xml", "early")) == []
    lab.cli("license", "token", "set", str(tmp_path / "old.tok"))
    lab.cli("vm", "create", "moved", "--vgpu", "L40S-4Q", "--start")
    lab.cli("vm", "create", "agentvm", "--vgpu", "L40S-4Q", "--start", "--licence-delivery", "agent")
    lab.cli("vm", "create", "agentless", "--vgpu", "L40S-4Q", "--start", "--licence-delivery", "agent")
    for vm in ("early", "moved", "agentvm"):
        lab.cli("sim", "guest", "start", lab.vgpu(vm), "--os", "linux", "--licensing", "never")
    lab.cli("sim", "guest", "start", lab.vgpu("agentless"), "--os", "linux", "--licensing", "never", "--no-agent")
    (tmp_path / "new.tok").write_bytes(make_token(server="new-dls.example.test"))
    out = lab.cli("license", "token", "set", str(tmp_path / "new.tok"))
    # a token change goes to the running agent VMs at once
    assert "agentvm: delivered through the guest agent" in out and "agentless: agent delivery failed" in out
    found = json.loads(lab.cli("license", "check", "--json", rc=10))["findings"]
    assert {(f["kind"], f["vm"]) for f in found} == {
        ("token-not-delivered", "early"), ("token-not-delivered", "agentless"),
        ("token-expired-or-other-server", "moved")}
    assert "guest agent" in next(f["evidence"] for f in found if f["vm"] == "agentless")
    # the fix for "early": its mode re-renders its XML with the item (for its next start)
    lab.cli("license", "delivery", "early", "fwcfg")
    assert [n for n, _ in domain.fwcfg_entries(lab.cli("vm", "xml", "early"))] == \
        ["opt/dev.vgpumgr/nls/ft1/client_configuration_token"]

    (tmp_path / "expired.tok").write_bytes(make_token(exp=time.time() - 3600))
    out = lab.cli("license", "token", "set", str(tmp_path / "expired.tok"))
    assert "expired" in out
    lab.cli("vm", "stop", "moved")
    lab.cli("vm", "start", "moved")  # the start hands the guest the (expired) token set now
    guests.stop(lab.root, lab.vgpu("moved"))
    lab.cli("sim", "guest", "start", lab.vgpu("moved"), "--os", "linux", "--licensing", "token")
    assert lab.licence("moved") != "licensed"  # the guest does not license with an expired token
    found = {(f["kind"], f["vm"]) for f in json.loads(lab.cli("license", "check", "--json", rc=10))["findings"]}
    assert ("token-expired-or-other-server", "moved") in found


def test_running_without_a_seat_once_a_pool_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Q-series vGPUs started in warn mode with no pool, then a vWS pool added: 0 of 2 seats are used, and the
    check (CLI and web page) says so instead of "the ledger agrees"."""
    monkeypatch.setenv("VGPUMGR_LICENCE_MODE", "warn")
    lab = Host(tmp_path)
    for vm in ("q1", "q2"):
        lab.cli("vm", "create", vm, "--vgpu", "L40S-4Q", "--start")
        guests.start(lab.root, lab.vgpu(vm), vm_uuid=lab.vm_uuid(vm), vm_name=vm)
    lab.cli("license", "add", "vws", "--edition", "vWS", "--seats", "10")
    assert "0" in lab.cli("license", "list").splitlines()[1].split()  # no seat used
    out = lab.cli("license", "check", rc=10)
    assert "agrees" not in out
    found = json.loads(lab.cli("license", "check", "--json", rc=10))["findings"]
    assert sorted((f["kind"], f["vm"]) for f in found) == [("running-without-seat", "q1"),
                                                           ("running-without-seat", "q2")]
    assert "vWS" in found[0]["evidence"]
    svc = Service(lab.cfg)
    admin = tokens.create_token(lab.cfg, "admin", "admin")
    client = TestClient(create_app(lab.cfg, service=svc, watch=False))
    csrf = re.search(r'name="csrf" value="([^"]*)"', client.get("/ui/login").text).group(1)
    client.post("/ui/login", data={"token": admin, "csrf": csrf, "next": "/ui/"}, follow_redirects=False)
    page = client.get("/ui/licences").text
    assert "The ledger agrees" not in page and 'data-kind="running-without-seat"' in page


def test_token_commands_refuse_bad_input(lab: Host, tmp_path: Path) -> None:
    lab.cli("license", "token", "show")
    assert "no licence token is set" in lab.outputs[-2]
    lab.cli("license", "token", "set", rc=2)
    lab.cli("license", "token", "set", str(tmp_path / "missing.tok"), rc=3)
    (tmp_path / "empty.tok").write_bytes(b"")
    lab.cli("license", "token", "set", str(tmp_path / "empty.tok"), rc=2)
    (tmp_path / "huge.tok").write_bytes(b"x" * (licence_token.MAX_TOKEN_BYTES + 1))
    lab.cli("license", "token", "set", str(tmp_path / "huge.tok"), rc=2)
    lab.cli("license", "token", "set", str(tmp_path), rc=2)  # a directory
    (tmp_path / "t.tok").write_bytes(make_token())
    lab.cli("license", "token", "set", str(tmp_path / "t.tok"), "--pool", "nosuch", rc=3)
    lab.cli("license", "token", "remove", rc=3)
    lab.cli("license", "token", "set", str(tmp_path / "t.tok"), "--pool", "lab-vws")
    assert (lab.state / "licence-token" / "pool-lab-vws.tok").is_file()
    lab.cli("license", "token", "remove", "--pool", "lab-vws")
    assert not (lab.state / "licence-token" / "pool-lab-vws.tok").exists()
    for argv in (("license", "delivery", "nosuch", "carrier-pigeon"),
                 ("vm", "create", "x", "--vgpu", "L40S-4Q", "--licence-delivery", "smoke")):
        with pytest.raises(SystemExit) as exc:  # argparse refuses an unknown mode, naming the choices
            lab.cli(*argv)
        assert exc.value.code == 2
    lab.cli("license", "delivery", "--pool", "lab-vws", "smoke", rc=2)
    lab.cli("license", "deliver", "nosuch", rc=3)
    lab.cli("vm", "create", "noagent", "--vgpu", "L40S-4Q", "--start", "--licence-delivery", "agent")
    lab.cli("license", "deliver", "noagent", rc=3)  # no token set now
    lab.cli("license", "token", "set", str(tmp_path / "t.tok"))
    lab.cli("sim", "guest", "start", lab.vgpu("noagent"), "--os", "windows", "--no-agent")
    err_out = lab.cli("license", "deliver", "noagent", rc=4)  # the guest is not ready: a conflict, not an outage
    assert err_out == "" and "guest agent" in lab.outputs[-1]


def test_pool_token_and_pool_delivery_mode(lab: Host, tmp_path: Path) -> None:
    default, pooled = make_token(server="a.example.test"), make_token(server="b.example.test")
    (tmp_path / "a.tok").write_bytes(default)
    (tmp_path / "b.tok").write_bytes(pooled)
    lab.cli("license", "token", "set", str(tmp_path / "a.tok"))
    lab.cli("license", "token", "set", str(tmp_path / "b.tok"), "--pool", "lab-vws")
    lab.cli("license", "delivery", "--pool", "lab-vws", "agent")
    lab.cli("vm", "create", "p", "--vgpu", "L40S-4Q", "--start")
    assert domain.fwcfg_entries(lab.cli("vm", "xml", "p")) == []  # the pool says agent
    lab.cli("sim", "guest", "start", lab.vgpu("p"), "--os", "linux", "--licensing", "token")
    assert json.loads(lab.cli("license", "deliver", "p", "--json"))["fingerprint"] == licence_token.fingerprint(pooled)
    [got] = (lab.guest("p") / LINUX_DIR).glob("*.tok")
    assert got.read_bytes() == pooled
    assert "restart nvidia-gridd" in (lab.guest("p") / "services.log").read_text()
    assert lab.licence("p") == "licensed"


def test_fwcfg_names_are_checked() -> None:
    from vgpumgr.errors import InvalidInput

    assert domain.check_fwcfg_entry("opt/dev.vgpumgr/nls/ft1/client_configuration_token", "/x/y.tok")
    for bad in ("etc/foo", "opt/org.qemu/x", "opt/" + "a" * 52, "opt/with space"):
        with pytest.raises(InvalidInput):
            domain.check_fwcfg_entry(bad, "/x/y.tok")
    with pytest.raises(InvalidInput):
        domain.check_fwcfg_entry("opt/dev.vgpumgr/x", "relative.tok")
    spec = domain.VmSpec(name="v", memory_mib=1024, fwcfg=[("opt/dev.vgpumgr/nls/ft2/client_configuration_token",
                                                            "/var/lib/vgpumgr/fwcfg/v.tok")])
    xml = domain.render(spec)
    assert "<sysinfo type=\"fwcfg\">" in xml
    assert os.path.basename(domain.fwcfg_entries(xml)[0][1]) == "v.tok"


def test_the_libvirt_prepare_hook_hands_qemu_the_current_token(lab: Host, tmp_path: Path) -> None:
    """libvirtd runs the prepare hook right before QEMU reads the item's file: it gets the token set now, or an
    empty file without one (QEMU would refuse to start on a missing file; the helper ignores an empty one)."""
    first, second = make_token(), make_token()
    (tmp_path / "1.tok").write_bytes(first)
    lab.cli("license", "token", "set", str(tmp_path / "1.tok"))
    lab.cli("vm", "create", "hooked", "--vgpu", "L40S-4Q")
    svc = Service(lab.cfg)
    xml = svc.vm_xml("hooked")
    [(_name, path)] = domain.fwcfg_entries(xml)
    assert Path(path).read_bytes() == first
    licence_token.store(lab.state, second)  # changed behind vgpumgr's back (no refresh)
    res = svc.libvirt_prepare("hooked", xml)
    assert res["licence"]["fingerprint"] == licence_token.fingerprint(second)
    assert Path(path).read_bytes() == second
    licence_token.remove(lab.state)
    res = svc.libvirt_prepare("hooked", xml)
    assert res["licence"]["fingerprint"] is None and Path(path).read_bytes() == b""
    [row] = [r for r in json.loads(lab.cli("license", "delivery", "hooked", "--json"))]
    assert "no licence token is set" in row["error"]


def test_a_domain_with_another_tools_fwcfg_item_validates_and_takes_the_token(lab: Host, tmp_path: Path) -> None:
    """OVMF's own items (opt/ovmf/X-PciMmio64Mb, for a large-BAR GPU) are not vgpumgr's to name: a domain that
    carries one validates, and changing its delivery keeps that item while the token's item comes and goes."""
    token = make_token()
    (tmp_path / "nls.tok").write_bytes(token)
    lab.cli("license", "token", "set", str(tmp_path / "nls.tok"))
    lab.cli("vm", "create", "bar", "--vgpu", "L40S-4Q", "--licence-delivery", "agent")
    svc = Service(lab.cfg)
    root = domain.parse_xml(svc.vm_xml("bar"))
    domain.set_fwcfg(root, [("opt/ovmf/X-PciMmio64Mb", "/unused")], "opt/ovmf/")
    entry = root.find("sysinfo/entry")
    del entry.attrib["file"]
    entry.text = "262144"
    xml = etree.tostring(root, encoding="unicode")
    domain.validate(xml)  # libvirt's domain.rng accepts it, and so must vgpumgr's own checks
    svc.virt().define(xml, replace=True)
    assert domain.fwcfg_entries(svc.vm_xml("bar")) == [("opt/ovmf/X-PciMmio64Mb", None)]

    lab.cli("license", "delivery", "bar", "fwcfg")
    copy = lab.state / "fwcfg" / f"{lab.vm_uuid('bar')}.tok"
    xml = svc.vm_xml("bar")
    assert domain.fwcfg_entries(xml) == [("opt/ovmf/X-PciMmio64Mb", None),
                                         ("opt/dev.vgpumgr/nls/ft1/client_configuration_token", str(copy))]
    domain.validate(xml)
    assert copy.read_bytes() == token
    lab.cli("license", "delivery", "bar", "agent")
    assert domain.fwcfg_entries(svc.vm_xml("bar")) == [("opt/ovmf/X-PciMmio64Mb", None)]
    # vgpumgr's own items are still held to its rules, and a name given twice is refused whoever gave it
    from vgpumgr.errors import InvalidInput

    root = domain.parse_xml(xml)
    etree.SubElement(root.find("sysinfo"), "entry", name="opt/dev.vgpumgr/with space", file=str(copy))
    etree.SubElement(root.find("sysinfo"), "entry", name="opt/ovmf/X-PciMmio64Mb").text = "1"
    with pytest.raises(InvalidInput, match=r"'opt/dev.vgpumgr/with space' is not usable.*given twice"):
        domain.validate(etree.tostring(root, encoding="unicode"))


def test_token_set_reads_no_more_than_the_limit_from_a_pipe_or_a_device(lab: Host, tmp_path: Path) -> None:
    """A FIFO (with a writer or none) and /dev/zero are refused as what they are, before anything is read
    (vgpumgr.userinput.files: regular files only); a file over the limit is refused by its size."""
    fifo = tmp_path / "endless.tok"
    os.mkfifo(fifo)
    lab.cli("license", "token", "set", str(fifo), rc=2)  # no writer: never waits for one
    assert "is a FIFO" in lab.outputs[-1]
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer holding it open, with bytes waiting
    try:
        os.write(writer, make_token())
        lab.cli("license", "token", "set", str(fifo), rc=2)
        assert "is a FIFO" in lab.outputs[-1]
    finally:
        os.close(writer)
    lab.cli("license", "token", "set", "/dev/zero", rc=2)
    assert "/dev/zero is a character device" in lab.outputs[-1]
    (tmp_path / "big.tok").write_bytes(make_token() + b"x" * licence_token.MAX_TOKEN_BYTES)
    lab.cli("license", "token", "set", str(tmp_path / "big.tok"), rc=2)
    assert f"more than the {licence_token.MAX_TOKEN_BYTES} it may have" in lab.outputs[-1]
    assert licence_token.all_info(lab.state) == []


def test_a_vm_that_leaves_fwcfg_loses_its_token_copy(lab: Host, tmp_path: Path) -> None:
    """The per-VM copy (readable by QEMU's group) exists only while the VM's delivery is fwcfg: switching the VM
    to agent or none removes it, and a token change rewrites only the copies of VMs still in fwcfg mode."""
    first, second = make_token(), make_token()
    (tmp_path / "1.tok").write_bytes(first)
    (tmp_path / "2.tok").write_bytes(second)
    lab.cli("license", "token", "set", str(tmp_path / "1.tok"))
    lab.cli("vm", "create", "a", "--vgpu", "L40S-4Q")
    lab.cli("vm", "create", "b", "--vgpu", "L40S-4Q")
    copy_a = lab.state / "fwcfg" / f"{lab.vm_uuid('a')}.tok"
    copy_b = lab.state / "fwcfg" / f"{lab.vm_uuid('b')}.tok"
    assert copy_a.read_bytes() == first and copy_b.read_bytes() == first
    lab.cli("license", "delivery", "a", "agent")
    assert not copy_a.exists() and domain.fwcfg_entries(lab.cli("vm", "xml", "a")) == []
    lab.cli("license", "delivery", "a", "fwcfg")
    assert copy_a.read_bytes() == first and domain.fwcfg_entries(lab.cli("vm", "xml", "a"))
    lab.cli("license", "delivery", "a", "none")
    assert not copy_a.exists()
    # the pool's delivery becomes agent (b's XML is left until its next refresh): the next token change rewrites
    # a's copy (fwcfg chosen for the VM itself) and removes b's
    lab.cli("license", "delivery", "a", "fwcfg")
    lab.cli("license", "delivery", "--pool", "lab-vws", "agent")
    assert copy_b.read_bytes() == first
    out = lab.cli("license", "token", "set", str(tmp_path / "2.tok"))
    assert copy_a.read_bytes() == second and not copy_b.exists()
    assert "1 VM fw_cfg copy refreshed" in out


def test_an_unchanged_token_copy_still_gets_its_permissions(tmp_path: Path) -> None:
    data = make_token()
    path = licence_token.write_vm_copy(tmp_path, "5f0c2e1a-3b4d-4c5e-8f60-718293a4b5c6", data)
    os.chmod(path, 0o644)
    assert licence_token.write_vm_copy(tmp_path, "5f0c2e1a-3b4d-4c5e-8f60-718293a4b5c6", data) == path
    gid = licence_token._qemu_group() if os.geteuid() == 0 else None
    assert stat.S_IMODE(path.stat().st_mode) == (0o640 if gid is not None else 0o600)
    assert path.stat().st_gid == (gid if gid is not None else os.getegid())


def test_setting_the_same_token_again_restarts_no_guest_service(lab: Host, tmp_path: Path) -> None:
    token = make_token()
    (tmp_path / "nls.tok").write_bytes(token)
    lab.cli("license", "token", "set", str(tmp_path / "nls.tok"))
    lab.cli("vm", "create", "ag", "--vgpu", "L40S-4Q", "--start", "--licence-delivery", "agent")
    lab.cli("sim", "guest", "start", lab.vgpu("ag"), "--os", "linux", "--licensing", "token")
    lab.cli("license", "deliver", "ag")
    log = lab.guest("ag") / "services.log"
    assert log.read_text().count("restart nvidia-gridd") == 1
    out = lab.cli("license", "token", "set", str(tmp_path / "nls.tok"))
    assert out.startswith("licence token unchanged for every VM") and "ag:" not in out
    assert log.read_text().count("restart nvidia-gridd") == 1
    events = [e for e in json.loads(lab.cli("audit", "list", "--json")) if e["action"] == "licence.token.set"]
    assert len(events) == 2  # the second set is still audited
    (tmp_path / "new.tok").write_bytes(make_token())
    out = lab.cli("license", "token", "set", str(tmp_path / "new.tok"))
    assert "licence token changed" in out and "ag: delivered through the guest agent" in out
    assert log.read_text().count("restart nvidia-gridd") == 2


def test_token_copy_names_follow_the_one_uuid_rule() -> None:
    """A copy is named by the VM's UUID (8-4-4-4-12, as vgpumgr.ids reads it) or else by its VM name: a VM named
    like 32 hex digits is a name, not a malformed UUID."""
    state = Path("/state")
    upper = "5F0C2E1A-3B4D-4C5E-8F60-718293A4B5C6"
    assert licence_token.fwcfg_path(state, upper).name == upper.lower() + ".tok"
    hexname = "5f0c2e1a3b4d4c5e8f60718293a4b5c6"
    assert licence_token.fwcfg_path(state, hexname).name == hexname + ".tok"
    assert licence_token.fwcfg_path(state, "pve-106").name == "pve-106.tok"


def test_rest_delivery_to_a_guest_not_ready_is_a_409_and_a_refusal_leaves_no_row(lab: Host, tmp_path: Path) -> None:
    """A guest whose agent does not answer is the guest's state, not an outage: 409 `guest-not-ready` with the
    reason (a client's retry logic reads 5xx as "the service is down"). A refused delivery to a libvirt domain
    vgpumgr keeps no record of (the test driver's own `test`) adds no licence_deliveries row."""
    (tmp_path / "t.tok").write_bytes(make_token())
    lab.cli("license", "token", "set", str(tmp_path / "t.tok"))
    lab.cli("vm", "create", "noagent", "--vgpu", "L40S-4Q", "--start", "--licence-delivery", "agent")
    lab.cli("sim", "guest", "start", lab.vgpu("noagent"), "--os", "linux", "--no-agent")
    svc = Service(lab.cfg)
    admin = tokens.create_token(lab.cfg, "admin", "admin")
    client = TestClient(create_app(lab.cfg, service=svc, watch=False))
    h = {"Authorization": f"Bearer {admin}"}
    before = {r["vm"] for r in client.get("/v1/licences/deliveries", headers=h).json()["vms"]}
    for vm in ("noagent", "test"):
        r = client.post(f"/v1/licences/deliver/{vm}", headers=h)
        assert r.status_code == 409 and r.json()["type"].endswith("/guest-not-ready"), r.text
        assert "guest agent" in r.json()["detail"] and r.json()["hint"]
    after = {r["vm"]: r for r in client.get("/v1/licences/deliveries", headers=h).json()["vms"]}
    assert set(after) == before and "test" not in after
    assert "Guest agent is not responding" in after["noagent"]["error"]  # a VM it manages notes the failure
