"""NVIDIA's client configuration token as a secret of this host (docs/sources.md §23).

The token (`client_configuration_token_<timestamp>.tok`, from the NVIDIA Licensing Portal or a DLS appliance)
points a guest's licensing service at the licence server. vgpumgr keeps it as a file, never as a value:

* stored root-only (directory 0700, file 0600) in the state directory: `licence-token/default.tok`, or
  `licence-token/pool-<POOL>.tok` for a token that only VMs holding a seat of that pool get;
* never in the database a fleet shares, never in a log line, an audit event, an API answer or a metric:
  those carry only its fingerprint (`sha256:` and the first 16 hex digits of its SHA-256), the licence
  server URL and the expiry, read from the token where it is a readable JWT (NLS tokens are RS256 JWS);
* per VM, a copy that libvirt's QEMU reads for fw_cfg (`fwcfg/<vm-uuid>.tok`), written when the VM is
  created or about to start and removed with the VM.

A fleet shares the token by the operator's choice: run `vgpumgr license token set` on each host (or let
configuration management place the same file); the fingerprint in `token show` and in the audit trail tells
whether every host holds the same one.
"""

from __future__ import annotations

import base64
import contextlib
import grp
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vgpumgr.errors import InvalidInput, NotFound

TOKEN_DIR = "licence-token"
FWCFG_DIR_ENV = "VGPUMGR_FWCFG_DIR"
MAX_TOKEN_BYTES = 64 * 1024
DEFAULT = "default"
_POOL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# the group libvirt's QEMU runs as, by distribution (Debian/Ubuntu, Fedora/RHEL/SUSE)
QEMU_GROUPS = ("libvirt-qemu", "qemu", "kvm")


@dataclass(frozen=True)
class TokenInfo:
    """What may be shown about a token: never its bytes."""

    scope: str  # "default" or the pool's name
    fingerprint: str
    size: int
    server: str | None
    expires: datetime | None
    issued: datetime | None
    set_at: datetime

    def expired(self, now: datetime | None = None) -> bool:
        return self.expires is not None and self.expires <= (now or datetime.now(UTC))

    def to_json(self) -> dict[str, Any]:
        return {"scope": self.scope, "fingerprint": self.fingerprint, "size": self.size, "server": self.server,
                "expires": self.expires.isoformat() if self.expires else None,
                "issued": self.issued.isoformat() if self.issued else None,
                "set_at": self.set_at.isoformat(), "expired": self.expired()}


def fingerprint(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()[:16]


def _b64url(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _claims(data: bytes) -> dict[str, Any]:
    """The JWT payload of a token, or {} when it is not a readable JWT (the token stays usable: it is the
    guest's business to read it; vgpumgr only shows less about it)."""
    try:
        text = data.decode("ascii").strip()
        parts = text.split(".")
        if len(parts) != 3:
            return {}
        claims = json.loads(_b64url(parts[1]))
        return claims if isinstance(claims, dict) else {}
    except (UnicodeDecodeError, ValueError):
        return {}


def _server(claims: dict[str, Any]) -> str | None:
    conf = claims.get("service_instance_configuration")
    nodes = conf.get("node_url_list") if isinstance(conf, dict) else None
    for node in nodes if isinstance(nodes, list) else []:
        url = node.get("url") if isinstance(node, dict) else None
        if isinstance(url, str) and url:
            return url
    return None


def _when(value: Any) -> datetime | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return datetime.fromtimestamp(value, UTC)
    except (OverflowError, OSError, ValueError):
        return None


def describe(data: bytes, scope: str = DEFAULT, set_at: datetime | None = None) -> TokenInfo:
    claims = _claims(data)
    return TokenInfo(scope=scope, fingerprint=fingerprint(data), size=len(data), server=_server(claims),
                     expires=_when(claims.get("exp")), issued=_when(claims.get("iat")),
                     set_at=set_at or datetime.now(UTC))


_JWS_PART = re.compile(rb"[A-Za-z0-9_-]+={0,2}")


def shape_problem(data: bytes) -> str | None:
    """What `data` is instead of a client configuration token, or None when it has a token's shape: NLS tokens
    are signed JWTs (docs/sources.md §23), printable ASCII in three base64url parts whose first is a JSON header
    naming its algorithm."""
    text = data.strip()
    if not text:
        return "it is empty"
    if b"\0" in text or any(b < 9 or 13 < b < 32 or b == 127 for b in text):
        return "it is binary data, not text"
    try:
        text.decode("ascii")
    except UnicodeDecodeError:
        return "it is text with non-ASCII characters; a token is base64url text"
    lines = text.splitlines()
    if len(lines) > 1:
        if any(line.count(b":") >= 2 for line in lines[:5]):
            return f"it has {len(lines)} lines with colon-separated fields, like a password or group file"
        return f"it has {len(lines)} lines; a token is one line"
    parts = text.split(b".")
    if len(parts) != 3 or not all(_JWS_PART.fullmatch(p) for p in parts):
        if text.count(b":") >= 2:
            return "it has colon-separated fields, like a line of a password file"
        return f"it is one line of text in {len(parts)} dot-separated part(s), not three base64url parts"
    try:
        header = json.loads(_b64url(parts[0].decode()))
    except ValueError:
        return "its first part is not a base64url-encoded JSON header"
    if not isinstance(header, dict) or not isinstance(header.get("alg"), str):
        return "its header names no signing algorithm ('alg')"
    return None


def check_token(data: bytes, source: str, *, force: bool = False) -> bytes:
    """`data` if it may be stored as the token; `force` takes one without a token's shape (not an empty one, nor
    one over the size limit)."""
    if not data.strip():
        raise InvalidInput(f"{source} is empty", hint="give the .tok file downloaded from the licence server")
    if len(data) > MAX_TOKEN_BYTES:
        raise InvalidInput(f"{source} has {len(data)} bytes; a client configuration token is a few KiB",
                           hint="give the client_configuration_token_*.tok file itself")
    problem = shape_problem(data)
    if problem and not force:
        raise InvalidInput(f"{source} is not a client configuration token: {problem}",
                           hint="give the client_configuration_token_*.tok file downloaded from the licence server "
                                "(a signed JWT); --force takes a token of another shape, audited as such")
    return data


def scope_of(pool: str | None) -> str:
    if pool is None:
        return DEFAULT
    if not _POOL.match(pool):
        raise InvalidInput(f"'{pool}' is not a pool name",
                           hint="use the name `vgpumgr license list` shows")
    return pool


def token_dir(state_dir: Path) -> Path:
    return Path(state_dir) / TOKEN_DIR


def token_path(state_dir: Path, scope: str) -> Path:
    return token_dir(state_dir) / ("default.tok" if scope == DEFAULT else f"pool-{scope}.tok")


def _write_private(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `data` to `path` atomically, created with `mode` (never readable by others, even briefly)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def store(state_dir: Path, data: bytes, scope: str = DEFAULT) -> tuple[TokenInfo, TokenInfo | None]:
    """(the new token's info, the one it replaced) after storing `data` for `scope`."""
    d = token_dir(state_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    previous = info(state_dir, scope)
    _write_private(token_path(state_dir, scope), data)
    return describe(data, scope), previous


def read(state_dir: Path, scope: str = DEFAULT) -> bytes | None:
    try:
        return token_path(state_dir, scope).read_bytes()
    except FileNotFoundError:
        return None


def info(state_dir: Path, scope: str = DEFAULT) -> TokenInfo | None:
    path = token_path(state_dir, scope)
    try:
        data = path.read_bytes()
        mtime = datetime.fromtimestamp(path.stat().st_mtime, UTC)
    except FileNotFoundError:
        return None
    return describe(data, scope, mtime)


def all_info(state_dir: Path) -> list[TokenInfo]:
    d = token_dir(state_dir)
    found = []
    for path in sorted(d.glob("*.tok")) if d.is_dir() else []:
        scope = DEFAULT if path.name == "default.tok" else path.name[len("pool-"):-len(".tok")]
        if scope == DEFAULT or path.name.startswith("pool-"):
            i = info(state_dir, scope)
            if i is not None:
                found.append(i)
    return found


def remove(state_dir: Path, scope: str = DEFAULT) -> TokenInfo:
    previous = info(state_dir, scope)
    if previous is None:
        what = "no token is set" if scope == DEFAULT else f"no token is set for pool {scope}"
        raise NotFound(what, hint="`vgpumgr license token show` lists the tokens set")
    token_path(state_dir, scope).unlink()
    return previous


def for_vm(state_dir: Path, pools: list[str]) -> tuple[bytes, TokenInfo] | None:
    """The token a VM gets: that of the first of its seats' pools that has one, else the default token."""
    for scope in [*pools, DEFAULT]:
        data = read(state_dir, scope)
        if data is not None:
            return data, describe(data, scope)
    return None


# -- the per-VM copy libvirt's QEMU reads (fw_cfg) -------------------------------------------------------
def fwcfg_dir(state_dir: Path) -> Path:
    return Path(os.environ.get(FWCFG_DIR_ENV) or Path(state_dir) / "fwcfg")


def fwcfg_path(state_dir: Path, vm_key: str) -> Path:
    """The copy for a VM: by its libvirt UUID, or by its name where vgpumgr knows no UUID (Proxmox's pve-<vmid>)."""
    from vgpumgr import ids

    key = ids.mdev_uuid(vm_key) if ids.is_mdev_uuid(vm_key or "") else ids.vm_name(vm_key)
    return fwcfg_dir(state_dir) / f"{key}.tok"


def _qemu_group() -> int | None:
    for name in QEMU_GROUPS:
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            continue
    return None


def write_vm_copy(state_dir: Path, vm_uuid: str, data: bytes) -> Path:
    """Write (or refresh) the VM's copy: 0640 and group-owned by libvirt's QEMU group where root runs this and
    that group exists, else 0600 (QEMU runs as this user then: qemu:///session, or a root-run QEMU). The
    directory is 0711: QEMU can open a file it knows the name of, and list nothing."""
    d = fwcfg_dir(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o711)
    path = fwcfg_path(state_dir, vm_uuid)
    gid = _qemu_group() if os.geteuid() == 0 else None
    mode = 0o640 if gid is not None else 0o600
    if _same_copy(path, data, mode, gid):
        return path
    _write_private(path, data, mode)
    if gid is not None:
        os.chown(path, 0, gid)
    return path


def _same_copy(path: Path, data: bytes, mode: int, gid: int | None) -> bool:
    """True when `path` is a regular file holding `data`, left with `mode` and owned by root:`gid` (when
    given) so an unchanged copy still gets the permissions a new one would."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or f.read(len(data) + 1) != data:
            return False
        os.fchmod(fd, mode)
        if gid is not None:
            os.fchown(fd, 0, gid)
    return True


def remove_vm_copy(state_dir: Path, vm_uuid: str) -> bool:
    try:
        fwcfg_path(state_dir, vm_uuid).unlink()
        return True
    except FileNotFoundError:
        return False
