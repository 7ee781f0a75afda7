"""The libvirt holder check a release asks before it removes a device: the running domains that use it.

Asked once per release, so it keeps what it can: a real URI's connection stays open for the process (and
is opened again when it dies); a test URI's host is read from the files its `Virt`s save (in any process),
and parsed again only when a save changed them.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vgpumgr import ids
from vgpumgr.errors import NotFound, Unavailable, VgpuError
from vgpumgr.virt import domain as domxml
from vgpumgr.virt.driver import ACTIVE_STATES, DEFAULT_URI, STATE_NAMES, Virt, _libvirt


def holder_check(uri: str | None, state_dir: str | os.PathLike[str] | None, kind: str
                 ) -> Callable[[str], list[str]]:
    """A backend holder check: the running libvirt domains that use an mdev UUID (kind "mdev") or a PCI
    address (kind "pci"). A stopped domain holds nothing in the kernel, so it does not block a removal.
    When libvirt cannot be reached, it answers nothing: the backends' /proc check of the VFIO group stays."""
    uri = uri or os.environ.get("VGPUMGR_LIBVIRT_URI") or DEFAULT_URI
    if uri.startswith("test:///"):
        path = Path(state_dir) / "libvirt-test" if state_dir is not None else None
        checker: Callable[[str, str], list[str]] = _cached(_saved_checks, (uri, path),
                                                            lambda: _SavedHolders(uri, path))
    else:
        checker = _cached(_live_checks, uri, lambda: _LiveHolders(uri))
    return lambda key: checker(kind, key)


_checks_lock = threading.Lock()
_live_checks: dict[str, _LiveHolders] = {}
_saved_checks: dict[tuple[str, Path | None], _SavedHolders] = {}


def _cached(cache: dict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
    with _checks_lock:
        found = cache.get(key)
        if found is None:
            found = cache[key] = make()
        return found


def _answer(names: list[str]) -> list[str]:
    return [f"running libvirt domain {n}" for n in names]


class _LiveHolders:
    """One libvirt connection per URI for the process's holder checks (was: a new connection per release).
    libvirt connections may be shared by threads; only opening one is serialised here."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._virt: Virt | None = None
        self._lock = threading.Lock()

    def _connection(self) -> Virt:
        with self._lock:
            if self._virt is None:
                virt = Virt(self.uri)
                virt.conn  # noqa: B018 - connect now, under the lock; Unavailable when libvirt is down
                self._virt = virt
            return self._virt

    def _drop(self, virt: Virt) -> None:
        with self._lock:
            if self._virt is virt:
                self._virt = None
        virt.close()

    def __call__(self, kind: str, key: str) -> list[str]:
        for _ in range(2):
            v: Virt | None = None
            try:
                v = self._connection()
                names = v.domains_using_mdev(key) if kind == "mdev" else v.domains_using_pci(key)
                return _answer([n for n in names if v.state(n) in ("running", "paused")])
            except NotFound:  # a domain went away between the listing and its state: ask again
                continue
            except VgpuError:
                if v is None or _alive(v):
                    return []
                self._drop(v)  # libvirtd restarted or the socket closed: one new connection, once
        return []


def _alive(v: Virt) -> bool:
    """Whether the connection `v` opened still works (never opens one)."""
    try:
        return v._conn is not None and bool(v._conn.isAlive())
    except Exception:  # noqa: BLE001 - a closed connection may raise instead of answering
        return False


_NOTHING_READ = object()


class _SavedHolders:
    """Holders on a test-driver host, whose domains live in the files every `Virt` with a state_dir saves
    after each change (in any process): the domains that run or are paused, and the devices their XML
    assigns. Without saved files, the test URI's own host as a fresh connection finds it.

    A fresh connection restored from the files gave the same answer for ~1 ms of CPU per release (open,
    restore, list, XML); this reads state.json's few hundred bytes and parses again only when they changed
    (each save writes a new random "save" value into them)."""

    def __init__(self, uri: str, state_path: Path | None) -> None:
        self.uri = uri
        self.state_path = state_path
        self._seen: object = _NOTHING_READ  # state.json's bytes, or None: no saved host
        self._held: dict[tuple[str, str], list[str]] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str, key: str) -> list[str]:
        try:
            key = ids.mdev_uuid(key) if kind == "mdev" else ids.pci_address(key)
            with self._lock:
                current = self._read(self.state_path / "state.json") if self.state_path else None
                if current != self._seen:
                    self._held, self._seen = self._load() if current is not None else self._initial()
                return _answer(self._held.get((kind, key), []))
        except VgpuError:
            return []

    @staticmethod
    def _read(path: Path) -> bytes | None:
        try:
            return path.read_bytes()  # replaced atomically by every save: the old or the new, whole
        except FileNotFoundError:
            return None

    def _initial(self) -> tuple[dict[tuple[str, str], list[str]], None]:
        """The host a fresh connection to the URI finds (test:///default: its built-in domain)."""
        held: dict[tuple[str, str], list[str]] = {}
        with Virt(self.uri) as v, v._errors("list VMs"):
            inactive = _libvirt().VIR_DOMAIN_XML_INACTIVE
            for dom in sorted(v.conn.listAllDomains(0), key=lambda d: d.name()):
                if STATE_NAMES.get(dom.state()[0]) not in ("running", "paused"):
                    continue
                xmls = [dom.XMLDesc(0)] + ([dom.XMLDesc(inactive)] if dom.isPersistent() else [])
                _add_references(held, dom.name(), xmls)
        return held, None

    def _load(self) -> tuple[dict[tuple[str, str], list[str]], object]:
        assert self.state_path is not None
        snapshot = self.state_path / "state.json"
        held: dict[tuple[str, str], list[str]] = {}
        try:
            # under the lock every save takes, so that state.json and the XML files read belong to one save
            with open(self.state_path / ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                seen = self._read(snapshot)
                if seen is None:  # removed meanwhile
                    return self._initial()
                for r in sorted(json.loads(seen)["domains"], key=lambda r: r["name"]):
                    if r.get("state") in ACTIVE_STATES:  # a restore starts these: running or paused
                        xml = (self.state_path / f"{ids.mdev_uuid(r['uuid'])}.xml").read_text()
                        _add_references(held, r["name"], [xml])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise Unavailable(f"the saved test-driver state {snapshot} is unreadable: {exc}",
                              hint=f"remove {self.state_path} to start from an empty test host") from exc
        return held, seen


def _add_references(held: dict[tuple[str, str], list[str]], name: str, xmls: list[str]) -> None:
    for xml in xmls:
        for kind, keys in domxml.referenced_devices(xml).items():
            for k in keys:
                names = held.setdefault((kind, k), [])
                if name not in names:
                    names.append(name)
