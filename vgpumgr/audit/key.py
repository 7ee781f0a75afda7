"""The host's Ed25519 key that signs audit checkpoints, and the canonical bytes a signature covers.

The private half lives in the state dir (0600, made on first use); the public half beside it (0644) is
what an auditor's verifier needs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from vgpumgr.errors import AuditBroken

KEY_FILE = "audit-key.pem"
PUBLIC_KEY_FILE = "audit-key.pub"


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def signed_bytes(record: dict[str, Any]) -> bytes:
    """What the signature covers: every field but the signature itself."""
    return canonical({k: v for k, v in record.items() if k != "sig"})


def digest(record: dict[str, Any]) -> str:
    """The next checkpoint's `prev`: sha256 of this whole record, signature included."""
    return hashlib.sha256(canonical(record)).hexdigest()


class HostKey:
    """This host's Ed25519 checkpoint key; `private` is None where only the public key is readable."""

    def __init__(self, public: Any, private: Any = None) -> None:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self.public, self.private = public, private
        self.key_id = hashlib.sha256(public.public_bytes(Encoding.Raw, PublicFormat.Raw)).hexdigest()[:16]

    def public_pem(self) -> str:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        return self.public.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo).decode()

    def sign(self, data: bytes) -> str:
        if self.private is None:
            raise AuditBroken("the audit host key's private half is not readable",
                              hint="run as the user that owns the state directory (root on a real host)")
        return base64.b64encode(self.private.sign(data)).decode()

    def verifies(self, data: bytes, signature: str) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self.public.verify(base64.b64decode(signature, validate=True), data)
        except (InvalidSignature, ValueError):
            return False
        return True


def load_key(state_dir: Path, create: bool) -> HostKey | None:
    """The host key from the state dir; with `create`, a new one the first time (private half 0600)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key_path, pub_path = state_dir / KEY_FILE, state_dir / PUBLIC_KEY_FILE
    if create and not key_path.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        tmp = state_dir / f".{KEY_FILE}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, key_path)  # another process may have won the race: then its key stands
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    try:
        private = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except PermissionError:
        private = None
    except FileNotFoundError:
        if not pub_path.exists():
            return None
        private = None
    except ValueError as exc:
        raise AuditBroken(f"{key_path} is not an Ed25519 private key", hint=str(exc)) from exc
    if private is not None:
        key = HostKey(private.public_key(), private)
        if not pub_path.exists() or pub_path.read_text() != key.public_pem():
            tmp = state_dir / f".{PUBLIC_KEY_FILE}.{os.getpid()}.tmp"
            tmp.write_text(key.public_pem())
            tmp.chmod(0o644)
            os.replace(tmp, pub_path)
        return key
    try:
        return HostKey(serialization.load_pem_public_key(pub_path.read_bytes()))
    except (OSError, ValueError) as exc:
        raise AuditBroken(f"cannot read the audit public key {pub_path}", hint=str(exc)) from exc
