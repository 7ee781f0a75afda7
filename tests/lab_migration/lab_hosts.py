"""The lab's libvirt hosts (scripts/mdev-lab-trixie run --hosts 2) as the migration tests see them.

Each host (a, b) is a mount and UTS namespace of the one guest with its own libvirtd (qemu+tcp://lab-NAME/system),
its own vgpumgr state (/var/lib/vgpumgr, /etc/vgpumgr, /run/vgpumgr inside it; /run/lab-hosts/NAME/... from
outside) and the project's libvirt hook. The tests run outside the namespaces: they reach each vgpumgr through
its service's unix socket (REST, an admin token) or its CLI (`lab-host NAME vgpumgr ...`), and each libvirtd
over TCP. The hosts share one kernel, so each one's sysfs shows both hosts' mdevs.

Run as a script inside a host (`lab-host a python lab_hosts.py tokens`) it writes that host's hook and admin
tokens: one process per host instead of two `vgpumgr token create` (Python starts slowly under TCG).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lxml import etree

MDEV_DEVICES = Path("/sys/bus/mdev/devices")
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
# QEMU trace events that show a VFIO device's migration in the domain's log (QEMU's "log" trace backend
# writes to stderr, which libvirt keeps in /var/log/libvirt/qemu/<domain>.log)
TRACE_EVENTS = ("vfio_migration_set_state", "vfio_save_setup", "vfio_save_complete_precopy", "vfio_save_block",
                "vfio_load_state_device_data")
# Debian 13's kernel is built without CONFIG_IOMMUFD, so the kernel's IOVA bitmap helpers are stubs and a
# VFIO device's DMA dirty-page report (mtty's log_ops) fails with EOPNOTSUPP. QEMU is told to use no device
# dirty tracking and to migrate anyway (it then counts all guest RAM as dirty for the device); the device's
# own state still moves through its VFIO migration (pre-copy, stop-copy).
LAB_DEVICE_PROPERTIES = {"x-device-dirty-page-tracking": "off", "enable-migration": "on"}


def in_migration_lab() -> bool:
    """Inside the Debian 13 lab guest with hosts a and b."""
    return (os.environ.get("MDEVLAB_GUEST") == "1" and os.environ.get("MDEVLAB_SUITE") == "trixie"
            and os.environ.get("MDEVLAB_HOSTS", "").split()[:2] == ["a", "b"])


class LabHost:
    def __init__(self, name: str) -> None:
        self.name = name
        self.dir = Path("/run/lab-hosts") / name
        self.uri = f"qemu+tcp://lab-{name}/system"
        self._conn: Any = None

    def __repr__(self) -> str:
        return f"LabHost({self.name})"

    # -- vgpumgr ------------------------------------------------------------------------------------------
    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """`vgpumgr ARGS` on this host (its namespaces: its records, socket and libvirtd)."""
        env = dict(os.environ, VGPUMGR_DOMAIN_TYPE="qemu")
        return subprocess.run(["lab-host", self.name, "vgpumgr", *args], capture_output=True, text=True,
                              timeout=timeout, env=env)

    def cli_json(self, *args: str, timeout: float = 300) -> Any:
        r = self.cli(*args, "--json", timeout=timeout)
        assert r.returncode == 0, f"{self}: vgpumgr {' '.join(args)} exited {r.returncode}: {r.stderr}{r.stdout}"
        return json.loads(r.stdout)

    def api(self, method: str, path: str, body: Any = None, timeout: float = 120) -> tuple[int, Any]:
        """One REST request to this host's vgpumgr service with its admin token: (status, JSON body)."""
        token = (self.dir / "etc-vgpumgr" / "admin.token").read_text().strip()
        conn = _UnixHTTP(str(self.dir / "run-vgpumgr" / "api.sock"), timeout)
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, (json.loads(raw) if raw else None)
        finally:
            conn.close()

    def ok(self, method: str, path: str, body: Any = None) -> Any:
        status, payload = self.api(method, path, body)
        assert status < 300, f"{self}: {method} {path} -> {status} {payload}"
        return payload

    def vgpus(self, vm: str | None = None, live: bool = True) -> list[dict[str, Any]]:
        query = f"?live={'true' if live else 'false'}" + (f"&vm={vm}" if vm else "")
        return self.ok("GET", f"/v1/vgpus{query}")

    def record(self, uuid: str) -> dict[str, Any] | None:
        """The newest record of the mdev `uuid` on this host, live or released."""
        found = [a for a in self.vgpus(live=True) + self.vgpus(live=False) if a["uuid"] == uuid]
        return max(found, key=lambda a: a["id"]) if found else None

    def audit(self, vm: str) -> list[dict[str, Any]]:
        return self.ok("GET", f"/v1/audit?vm={vm}")

    # -- libvirt ------------------------------------------------------------------------------------------
    def conn(self) -> Any:
        import libvirt

        if self._conn is None:
            # libvirt-python prints every error to stderr by default; the tests look at the exceptions instead
            libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
            self._conn = libvirt.open(self.uri)
        return self._conn

    def domain(self, name: str) -> Any:
        import libvirt

        try:
            return self.conn().lookupByName(name)
        except libvirt.libvirtError:
            return None

    def qemu_pid(self, name: str) -> int:
        return int((self.dir / "run-libvirt" / "qemu" / f"{name}.pid").read_text())

    def qemu_log(self, name: str) -> str:
        path = self.dir / "log-libvirt" / "qemu" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def remove_domain(self, name: str) -> None:
        dom = self.domain(name)
        if dom is None:
            return
        with contextlib.suppress(Exception):
            if dom.isActive():
                dom.destroy()
        with contextlib.suppress(Exception):
            dom.undefine()


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.unix_path)
        self.sock = s


# -- domains --------------------------------------------------------------------------------------------
def mdev_uuids(xml: str) -> list[str]:
    root = etree.fromstring(xml.encode())
    return [a.get("uuid") for a in root.iterfind("devices/hostdev[@type='mdev']/source/address")]


def domain_xml(name: str, mdev_uuid: str) -> str:
    """A small software-emulated domain (no disk, SeaBIOS only) holding one mdev, ready for the lab."""
    xml = (f"<domain type='qemu'><name>{name}</name><memory unit='MiB'>64</memory><vcpu>1</vcpu>"
           "<os><type arch='x86_64' machine='pc'>hvm</type></os><devices>"
           "<hostdev mode='subsystem' type='mdev' model='vfio-pci'>"
           f"<source><address uuid='{mdev_uuid}'/></source></hostdev></devices></domain>")
    return for_the_lab(xml)


def for_the_lab(xml: str) -> str:
    """`xml` with the QEMU trace events and the device properties the lab needs (see LAB_DEVICE_PROPERTIES);
    anything else (vgpumgr's metadata included) is kept."""
    root = etree.fromstring(xml.encode())
    q = f"{{{QEMU_NS}}}"
    if root.find(f"{q}commandline") is None:
        cmd = etree.SubElement(root, f"{q}commandline", nsmap={"qemu": QEMU_NS})
        for event in TRACE_EVENTS:
            etree.SubElement(cmd, f"{q}arg", value="-trace")
            etree.SubElement(cmd, f"{q}arg", value=event)
    if root.find(f"{q}override") is None:
        override = etree.SubElement(root, f"{q}override", nsmap={"qemu": QEMU_NS})
        # libvirt names the first hostdev hostdev0; its -device gets these properties
        frontend = etree.SubElement(etree.SubElement(override, f"{q}device", alias="hostdev0"), f"{q}frontend")
        for prop, value in LAB_DEVICE_PROPERTIES.items():
            etree.SubElement(frontend, f"{q}property", name=prop, type="string", value=value)
    return etree.tostring(root, encoding="unicode")


def vfio_trace(log: str, uuid: str) -> list[str]:
    """The VFIO trace lines of the mdev `uuid` in a QEMU log, without their pid@time prefix."""
    return [re.sub(r"^\d+@[\d.]+:", "", line) for line in log.splitlines()
            if f"({uuid})" in line and re.match(r"^\d+@[\d.]+:vfio_", line)]


def group_of(uuid: str) -> str:
    return f"/dev/vfio/{os.path.basename(os.readlink(MDEV_DEVICES / uuid / 'iommu_group'))}"


def holds(pid: int, path: str) -> bool:
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd) == path:
                return True
    return False


def wait_for(what: str, check: Any, timeout: float = 90, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


# -- inside a host: its tokens ----------------------------------------------------------------------------
def write_tokens() -> None:
    from api.tokens import create_token
    from vgpumgr.config import Config

    cfg = Config.resolve(sysfs_root="/")
    etc = Path("/etc/vgpumgr")
    for role in ("hook", "admin"):
        path = etc / f"{role}.token"
        if not path.exists():
            secret = create_token(cfg, f"lab-{role}", role)
            path.write_text(secret + "\n")
            path.chmod(0o600)


if __name__ == "__main__":
    if sys.argv[1:] != ["tokens"]:
        sys.exit("usage: lab_hosts.py tokens   (inside a lab host: lab-host NAME python lab_hosts.py tokens)")
    write_tokens()
