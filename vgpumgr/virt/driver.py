"""libvirt-python: define/start/stop/undefine domains, attach GPU devices, find who uses a device.

`import libvirt` happens on first connection, not at module import, so CLI commands that never touch
libvirt stay fast. libvirt errors become vgpumgr.errors with a hint.

The test driver keeps its domains in memory per process. With `state_dir`, a `test:///` connection
saves every domain's XML and run state under `state_dir/libvirt-test/` after each change and restores
them on connect, so separate CLI runs of the demo see one consistent host.

Long because: it is the one adapter over libvirt-python (life cycle, device changes, metadata, peer-to-peer
migration with its progress) plus the test driver's persistence that the simulated hosts rely on.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lxml import etree

from vgpumgr import ids
from vgpumgr.errors import (
    Busy,
    Conflict,
    GuestNotReady,
    InvalidInput,
    NotFound,
    PermissionDenied,
    Unavailable,
    VgpuError,
)
from vgpumgr.virt import domain as domxml

DEFAULT_URI = "qemu:///system"
STATE_NAMES = {0: "nostate", 1: "running", 2: "blocked", 3: "paused", 4: "shutdown", 5: "shutoff",
               6: "crashed", 7: "pmsuspended"}
TEST_AGENT_FILE = ".vgpumgr-agent"  # in <state>/libvirt-test/guests/: "module:Class" answering agent commands
ACTIVE_STATES = {"running", "blocked", "paused", "shutdown", "pmsuspended"}

# libvirt error codes (virErrorNumber) used below; numbers keep this module free of a libvirt import
_ERR_NO_SUPPORT = 3
_ERR_INVALID_ARG = 8
_ERR_OPERATION_FAILED = 9
_ERR_XML_ERROR = 27
_ERR_XML_DETAIL = 35
_ERR_NO_DOMAIN = 42
_ERR_OPERATION_INVALID = 55
_ERR_CONFIG_UNSUPPORTED = 67
_ERR_OPERATION_DENIED = 61
_ERR_ACCESS_DENIED = 88
_ERR_AUTH_FAILED = 45
_ERR_DOM_EXIST = 52
_ERR_HOOK_SCRIPT_FAILED = 70
_ERR_AGENT_UNRESPONSIVE = 86


def _libvirt() -> Any:
    try:
        import libvirt
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise Unavailable("the libvirt Python binding is not installed",
                          hint="pip install libvirt-python (needs libvirt-dev, pkg-config and gcc)") from exc
    if not getattr(libvirt, "_vgpumgr_quiet", False):
        # libvirt's default handler prints every error to stderr; ours are raised as exceptions instead
        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        libvirt._vgpumgr_quiet = True
    return libvirt


def _translate(exc: Exception, action: str) -> VgpuError:
    code = exc.get_error_code() if hasattr(exc, "get_error_code") else None
    msg = f"{action}: {exc}"
    if code == _ERR_NO_DOMAIN:
        return NotFound(msg, hint="`vgpumgr vm list` shows the VMs libvirt knows")
    if code in (_ERR_DOM_EXIST,) or (code == _ERR_OPERATION_FAILED and "already exists" in str(exc)):
        return Conflict(msg, hint="choose another name, or remove the other VM first")
    if code == _ERR_OPERATION_INVALID:
        return Conflict(msg, hint="the VM is not in a state that allows this; `vgpumgr vm list` shows it")
    if code in (_ERR_XML_ERROR, _ERR_XML_DETAIL, _ERR_CONFIG_UNSUPPORTED, _ERR_INVALID_ARG):
        return InvalidInput(msg, hint="libvirt refused the configuration; check the XML with --print-xml")
    if code in (_ERR_ACCESS_DENIED, _ERR_AUTH_FAILED, _ERR_OPERATION_DENIED):
        return PermissionDenied(msg, hint="run as root or as a member of the libvirt group")
    if code == _ERR_HOOK_SCRIPT_FAILED:  # e.g. a migration's destination hook refused the incoming domain
        return Conflict(msg, hint="a libvirt hook refused; its message above says why (nothing was changed)")
    if code == _ERR_AGENT_UNRESPONSIVE:
        return GuestNotReady(msg, hint="install and start the QEMU guest agent in the guest (qemu-guest-agent) and "
                                       "give the VM its channel (<channel type='unix'><target type='virtio' "
                                       "name='org.qemu.guest_agent.0'/></channel>)")
    if code == _ERR_NO_SUPPORT:
        return Unavailable(msg, hint="this libvirt driver does not support the operation")
    return VgpuError(msg, hint="libvirt's log (journalctl -u libvirtd or virtqemud) has the details")


def _name(name: str) -> str:
    # lookups accept names vgpumgr did not create, so only refuse what no libvirt name can hold
    if not isinstance(name, str) or not name or "\x00" in name:
        raise InvalidInput(f"{name!r} is not a VM name", hint="give the name `vgpumgr vm list` shows")
    return name


class Virt:
    def __init__(self, uri: str | None = None, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.uri = uri or os.environ.get("VGPUMGR_LIBVIRT_URI") or DEFAULT_URI
        self.state_path = (Path(state_dir) / "libvirt-test"
                           if state_dir is not None and self.uri.startswith("test:///") else None)
        self._conn: Any = None

    # -- connection --------------------------------------------------------------------------------
    @property
    def conn(self) -> Any:
        if self._conn is None:
            libvirt = _libvirt()
            try:
                self._conn = libvirt.open(self.uri)
            except libvirt.libvirtError as exc:
                raise Unavailable(
                    f"cannot connect to libvirt at {self.uri}: {exc}",
                    hint="is libvirtd (or virtqemud) running? check the URI (--connect, VGPUMGR_LIBVIRT_URI) "
                         "and that you are root or in the libvirt group; the demo uses test:///default",
                ) from exc
            if self.state_path is not None:
                self._restore()
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    def __enter__(self) -> Virt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        libvirt = _libvirt()
        try:
            yield
        except libvirt.libvirtError as exc:
            raise _translate(exc, action) from exc

    def _lookup(self, name: str) -> Any:
        with self._errors(f"VM '{name}'"):
            try:
                return self.conn.lookupByName(_name(name))
            except _libvirt().libvirtError as exc:
                if exc.get_error_code() == _ERR_NO_DOMAIN:
                    raise NotFound(f"VM '{name}' does not exist",
                                   hint="`vgpumgr vm list` shows the VMs libvirt knows") from exc
                raise

    # -- lifecycle ---------------------------------------------------------------------------------
    def define(self, xml: str, replace: bool = False, validate: bool = True) -> str:
        """Define a persistent domain; returns its name. Conflict when the name exists (unless replace).

        The XML is checked with domain.validate() first, for readable errors before libvirt's."""
        name = domxml.parse_xml(xml).findtext("name") if xml else None
        if validate:
            domxml.validate(xml)
        if not name:
            raise InvalidInput("the domain XML has no <name>", hint="render it with vgpumgr.virt.domain.render()")
        if not replace and self.exists(name):
            raise Conflict(f"a VM named '{name}' already exists",
                           hint="choose another name, or remove it first with `vgpumgr vm delete`")
        with self._errors(f"define VM '{name}'"):
            dom = self.conn.defineXML(xml)
        self._save()
        return dom.name()

    def start(self, name: str) -> None:
        dom = self._lookup(name)
        if dom.isActive():
            raise Conflict(f"VM '{name}' is already running", hint="stop it first, or leave it running")
        with self._errors(f"start VM '{name}'"):
            dom.create()
        self._save()

    def stop(self, name: str, force: bool = True) -> None:
        """Power off (force) or ask the guest to shut down. Stopping a stopped VM does nothing."""
        dom = self._lookup(name)
        if not dom.isActive():
            return
        with self._errors(f"stop VM '{name}'"):
            if force:
                dom.destroy()
            else:
                dom.shutdown()
        self._save()

    def undefine(self, name: str) -> None:
        dom = self._lookup(name)
        if dom.isActive():
            raise Busy(f"VM '{name}' is running", hint=f"stop it first: vgpumgr vm stop {name}")
        libvirt = _libvirt()
        wanted = (libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
                  | getattr(libvirt, "VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA", 0))
        with self._errors(f"undefine VM '{name}'"):
            for flags in (wanted | libvirt.VIR_DOMAIN_UNDEFINE_NVRAM, wanted, 0):
                try:
                    dom.undefineFlags(flags) if flags else dom.undefine()
                    break
                except libvirt.libvirtError as exc:
                    # drivers without UEFI/snapshots (e.g. the test driver) refuse those flags
                    if not flags or exc.get_error_code() not in (_ERR_INVALID_ARG, _ERR_NO_SUPPORT):
                        raise
        self._save()

    def migrate(self, name: str, dest_uri: str, *, xml: str | None = None, offline: bool = False,
                progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """libvirt's peer-to-peer migration to `dest_uri` (persistent there, undefined here; never post-copy).
        `xml`: the domain as the destination should get it (the running definition for a live migration, the
        persistent one offline; libvirt accepts changes that keep the guest's ABI, such as <metadata>).
        `progress` gets the job statistics (data total/processed/remaining, downtime) about twice a second.
        Returns the last statistics seen."""
        dom = self._lookup(name)
        libvirt = _libvirt()
        flags = (libvirt.VIR_MIGRATE_PEER2PEER | libvirt.VIR_MIGRATE_PERSIST_DEST
                 | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
                 | (libvirt.VIR_MIGRATE_OFFLINE if offline else libvirt.VIR_MIGRATE_LIVE))
        params = {}
        if xml:
            params[libvirt.VIR_MIGRATE_PARAM_PERSIST_XML if offline else libvirt.VIR_MIGRATE_PARAM_DEST_XML] = xml
        last: dict[str, Any] = {}
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.5):
                with contextlib.suppress(Exception):  # no job yet, or already over
                    stats = dom.jobStats()
                    if stats:
                        last.update(stats)
                        if progress:
                            progress(dict(stats))

        watcher = threading.Thread(target=watch, daemon=True) if not offline else None
        if watcher:
            watcher.start()
        try:
            with self._errors(f"migrate VM '{name}' to {dest_uri}"):
                dom.migrateToURI3(dest_uri, params, flags)
        finally:
            done.set()
            if watcher:
                watcher.join(timeout=2)
        self._save()
        return last

    # -- queries -----------------------------------------------------------------------------------
    def list(self) -> list[dict[str, str]]:
        with self._errors("list VMs"):
            doms = self.conn.listAllDomains(0)
            rows = [{"name": d.name(), "uuid": d.UUIDString(),
                     "state": STATE_NAMES.get(d.state()[0], "nostate")} for d in doms]
        return sorted(rows, key=lambda r: r["name"])

    def xml(self, name: str, inactive: bool = False, migratable: bool = False) -> str:
        dom = self._lookup(name)
        libvirt = _libvirt()
        flags = (libvirt.VIR_DOMAIN_XML_INACTIVE if inactive else 0) | (
            libvirt.VIR_DOMAIN_XML_MIGRATABLE if migratable else 0)
        with self._errors(f"read VM '{name}'"):
            return dom.XMLDesc(flags)

    def exists(self, name: str) -> bool:
        try:
            self._lookup(name)
        except NotFound:
            return False
        return True

    def state(self, name: str) -> str:
        dom = self._lookup(name)
        with self._errors(f"read VM '{name}'"):
            return STATE_NAMES.get(dom.state()[0], "nostate")

    def _domains_referencing(self, kind: str, wanted: str) -> list[str]:
        libvirt = _libvirt()
        names = []
        with self._errors("list VMs"):
            for dom in self.conn.listAllDomains(0):
                xmls = [dom.XMLDesc(0)]
                if dom.isActive() and dom.isPersistent():
                    xmls.append(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))  # next boot's config too
                if any(wanted in domxml.referenced_devices(x)[kind] for x in xmls):
                    names.append(dom.name())
        return sorted(names)

    def domains_using_mdev(self, uuid: str) -> list[str]:
        return self._domains_referencing("mdev", ids.mdev_uuid(uuid))

    def domains_using_pci(self, address: str) -> list[str]:
        return self._domains_referencing("pci", ids.pci_address(address))

    # -- devices -----------------------------------------------------------------------------------
    def attach(self, name: str, hostdev_xml: str) -> None:
        """Add a device to the persistent config, and to the running VM when it runs."""
        self._change_device(name, hostdev_xml, attach=True)

    def detach(self, name: str, hostdev_xml: str) -> None:
        self._change_device(name, hostdev_xml, attach=False)

    def _change_device(self, name: str, device_xml: str, attach: bool) -> None:
        libvirt = _libvirt()
        dom = self._lookup(name)
        verb = "attach to" if attach else "detach from"
        if not attach:
            self._require_device(dom, device_xml, name)
        flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG | (libvirt.VIR_DOMAIN_AFFECT_LIVE if dom.isActive() else 0)
        with self._errors(f"{verb} VM '{name}'"):
            try:
                if attach:
                    dom.attachDeviceFlags(device_xml, flags)
                else:
                    dom.detachDeviceFlags(device_xml, flags)
            except libvirt.libvirtError as exc:
                if exc.get_error_code() != _ERR_NO_SUPPORT or not self.uri.startswith("test:///"):
                    raise
                # the test driver has no device hot-plug: change the persistent definition instead
                config = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
                self.conn.defineXML(_edit_devices(config, device_xml, attach))
        self._save()

    def _require_device(self, dom: Any, device_xml: str, name: str) -> None:
        wanted = _device_identity(device_xml)
        config = dom.XMLDesc(_libvirt().VIR_DOMAIN_XML_INACTIVE)
        if wanted not in _identities(config):
            raise NotFound(f"VM '{name}' has no device {wanted[1]}",
                           hint=f"`vgpumgr vm show {name}` lists its devices")

    # -- the QEMU guest agent --------------------------------------------------------------------
    def agent(self, name: str, command: str, arguments: dict[str, Any] | None = None, timeout: int = 10) -> Any:
        """One QEMU guest agent command (qemuAgentCommand; libvirt has no API of its own for guest files) and its
        `return` value. The test driver has no agent: a `test:///` connection with a state directory answers
        from the simulated guest agent (vgpumgr.sim.guest_agent) of the VM's simulated guest."""
        dom = self._lookup(name)
        if not dom.isActive():
            raise Conflict(f"VM '{name}' is not running: its guest agent cannot answer",
                           hint=f"start it first (`vgpumgr vm start {name}`)")
        message = {"execute": command, **({"arguments": arguments} if arguments else {})}
        if self.uri.startswith("test:///"):
            return self._test_agent(name, dom).execute(name, message, timeout=timeout)
        try:
            import libvirt_qemu
        except ImportError as exc:  # pragma: no cover - shipped with libvirt-python
            raise Unavailable("libvirt_qemu is not installed", hint="reinstall libvirt-python") from exc
        with self._errors(f"guest agent of VM '{name}' ({command})"):
            reply = libvirt_qemu.qemuAgentCommand(dom, json.dumps(message), timeout, 0)
        return json.loads(reply).get("return")

    def _test_agent(self, name: str, dom: Any) -> Any:
        """The test driver's stand-in for the agent, named ("module:Class") in the saved state's `guests/`
        directory by the simulator that made the VM's guest (like a simulated root names its kernel)."""
        import importlib

        spec_file = self.state_path / "guests" / TEST_AGENT_FILE if self.state_path is not None else None
        if spec_file is None or not spec_file.is_file():
            raise GuestNotReady(f"guest agent of VM '{name}': Guest agent is not responding: QEMU guest agent is not "
                              "connected", hint="the test driver has no guest agent; `vgpumgr sim guest start` "
                                                "gives a simulated VM one")
        module, _, cls = spec_file.read_text().strip().partition(":")
        if not module.startswith("vgpumgr."):
            raise InvalidInput(f"{spec_file} names '{module}', which is not a vgpumgr module", hint="remove it")
        return getattr(importlib.import_module(module), cls)(self.state_path, ids.mdev_uuid(dom.UUIDString()))

    # -- test-driver persistence -------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[Path]:
        assert self.state_path is not None
        self.state_path.mkdir(parents=True, exist_ok=True)
        with open(self.state_path / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield self.state_path

    def _save(self) -> None:
        if self.state_path is None:
            return
        libvirt = _libvirt()
        with self._locked() as d, self._errors("save test-driver state"):
            records = []
            for dom in self.conn.listAllDomains(0):
                if not dom.isPersistent():
                    continue
                uuid = ids.mdev_uuid(dom.UUIDString())
                _write_atomic(d / f"{uuid}.xml", dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
                records.append({"uuid": uuid, "name": dom.name(), "state": STATE_NAMES.get(dom.state()[0])})
            # "save": different on every save, even when only a domain's XML changed, so that readers
            # (holder checks) can tell a new save by state.json's bytes alone
            _write_atomic(d / "state.json", json.dumps({"uri": self.uri, "save": os.urandom(8).hex(),
                                                        "domains": records}, indent=1))
            # only after the new state.json: a process killed in between leaves the old one naming these files
            keep = {f"{r['uuid']}.xml" for r in records}
            for stale in d.glob("*.xml"):
                if stale.name not in keep:
                    stale.unlink()

    def _restore(self) -> None:
        """Make a fresh test connection match the saved snapshot (none saved: leave the driver as is)."""
        libvirt = _libvirt()
        with self._locked() as d:
            snapshot = d / "state.json"
            if not snapshot.is_file():
                return
            try:
                records = json.loads(snapshot.read_text())["domains"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise Unavailable(f"the saved test-driver state {snapshot} is unreadable: {exc}",
                                  hint=f"remove {d} to start from an empty test host") from exc
            conn = self._conn
            with self._errors("restore test-driver state"):
                wanted = {ids.mdev_uuid(r["uuid"]) for r in records}
                for dom in conn.listAllDomains(0):
                    if dom.UUIDString() not in wanted:
                        if dom.isActive():
                            dom.destroy()
                        if dom.isPersistent():
                            dom.undefine()
                for r in records:
                    saved = d / f"{ids.mdev_uuid(r['uuid'])}.xml"
                    try:
                        text = saved.read_text()
                    except OSError as exc:
                        raise Unavailable(f"the saved test-driver state {snapshot} names {saved.name}, "
                                          f"which cannot be read: {exc.strerror}",
                                          hint=f"remove {d} to start from an empty test host") from exc
                    dom = conn.defineXML(text)
                    state = r.get("state")
                    if state in ACTIVE_STATES and not dom.isActive():
                        dom.create()
                    elif state not in ACTIVE_STATES and dom.isActive():
                        dom.destroy()
                    if state == "paused" and dom.state()[0] != libvirt.VIR_DOMAIN_PAUSED:
                        dom.suspend()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _device_identity(device_xml: str) -> tuple[str, str]:
    """("mdev", uuid) or ("pci", address) of a single <hostdev> element."""
    wrapped = f"<domain><devices>{device_xml}</devices></domain>"
    try:
        refs = domxml.referenced_devices(wrapped)
    except InvalidInput:
        refs = {"mdev": [], "pci": []}
    found = [("mdev", u) for u in refs["mdev"]] + [("pci", a) for a in refs["pci"]]
    if len(found) != 1:
        raise InvalidInput("the device XML must hold exactly one mdev or PCI <hostdev>",
                           hint="build it with vgpumgr.virt.domain.hostdev_xml()")
    return found[0]


def _identities(domain_xml: str) -> set[tuple[str, str]]:
    refs = domxml.referenced_devices(domain_xml)
    return {("mdev", u) for u in refs["mdev"]} | {("pci", a) for a in refs["pci"]}


def _edit_devices(domain_xml: str, device_xml: str, attach: bool) -> str:
    """The domain XML with the hostdev added, or with the hostdev that assigns the same device removed."""
    root = etree.fromstring(domain_xml.encode())
    devices = root.find("devices")
    wanted = _device_identity(device_xml)
    if attach:
        if wanted in _identities(domain_xml):
            raise Conflict(f"the VM already has device {wanted[1]}", hint="each device can be assigned once")
        devices.append(etree.fromstring(device_xml.encode()))
    else:
        for hd in devices.findall("hostdev"):
            with contextlib.suppress(InvalidInput):  # USB and other hostdevs are not ours
                if _device_identity(etree.tostring(hd, encoding="unicode")) == wanted:
                    devices.remove(hd)
    return etree.tostring(root, encoding="unicode")

