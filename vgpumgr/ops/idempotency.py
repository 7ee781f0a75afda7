"""Idempotency keys scoped to their caller and bound to the request that first used them.

`run_once(svc, caller=..., key=..., fingerprint=..., run=...)`: the first request with a key runs and its
answer is stored; the same caller repeating the same request (same fingerprint) gets that answer again; the
key with another request or from another caller is refused (422, naming the key). A key expires after
`VGPUMGR_IDEMPOTENCY_TTL` seconds (default 24 h); after that it may be used again.

While the first request runs, the key's row names the running process. A retry meanwhile gets 409; a
retry after that process died takes the key over and runs again with the same allocation keys, so what
the first attempt completed is found instead of made twice (and what it left half-done was rolled back).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, select, update

from vgpumgr.config import env_seconds
from vgpumgr.db.models import IdempotencyKey, utcnow
from vgpumgr.errors import Busy, InvalidInput, VgpuError
from vgpumgr.ops import leases
from vgpumgr.ops.context import Context

TTL_ENV = "VGPUMGR_IDEMPOTENCY_TTL"
DEFAULT_TTL_SECONDS = 24 * 3600.0
MAX_KEY = 128


class KeyReused(VgpuError):
    """The key was first used for another request, or by another caller."""

    status = 422
    exit_code = 2
    kind = "idempotency-key-reused"


def ttl_seconds() -> float:
    return env_seconds(TTL_ENV, DEFAULT_TTL_SECONDS, "3600")


def fingerprint(method: str, path: str, body: Any) -> str:
    """sha256 of the canonical JSON of (method, path, body): key order and whitespace do not matter."""
    canon = json.dumps([method.upper(), path, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                       default=str)
    return hashlib.sha256(canon.encode()).hexdigest()


def check_key(key: str) -> str:
    if not isinstance(key, str) or not 0 < len(key.strip()) <= MAX_KEY or not key.strip().isprintable():
        raise InvalidInput(f"idempotency key {key!r} is not usable",
                           hint=f"send 1-{MAX_KEY} printable characters, the same on every retry of one request")
    return key.strip()


def run_once(svc: Context, *, caller: str, key: str, fingerprint: str,
             run: Callable[[str], tuple[int, Any]]) -> tuple[int, Any, bool]:
    """(status, body, replayed). `run(allocation_key)` does the work and returns (status, JSON-able body);
    it should pass `allocation_key` on as the idempotency key of what it allocates."""
    key = check_key(key)
    claim_id, nonce, stored = _claim(svc, caller, key, fingerprint)
    if stored is not None:
        return stored[0], stored[1], True
    leases.crash_point("claimed")
    try:
        status, body = run(f"idem:{nonce}")
    except BaseException:
        with svc.tx() as s:  # a failed request did not use the key up: a corrected retry may run
            s.execute(delete(IdempotencyKey).where(IdempotencyKey.id == claim_id))
        raise
    body = json.loads(json.dumps(body, default=str))
    with svc.tx() as s:
        s.execute(update(IdempotencyKey).where(IdempotencyKey.id == claim_id)
                  .values(status=status, response=body, owner_boot=None, owner_pid=None, owner_started=None))
    return status, body, False


def _claim(svc: Context, caller: str, key: str, fp: str) -> tuple[int, str, tuple[int, Any] | None]:
    """Find or take the key: (row id, nonce, stored answer or None when this request is to run)."""
    now = utcnow()
    me = leases.owner_values(svc, now)
    owner = {"owner_boot": me["owner_boot"], "owner_pid": me["owner_pid"], "owner_started": me["owner_started"]}
    with svc.tx() as s:
        h = svc.host_id(s)
        row = s.scalar(select(IdempotencyKey).where(IdempotencyKey.host_id == h, IdempotencyKey.key == key))
        if row is not None and row.expires_at <= now:
            s.delete(row)
            s.flush()
            row = None
        if row is None:
            row = IdempotencyKey(host_id=h, key=key, caller=caller, fingerprint=fp, nonce=secrets.token_hex(16),
                                 created_at=now, expires_at=now + timedelta(seconds=ttl_seconds()), **owner)
            s.add(row)
            s.flush()
            return row.id, row.nonce, None
        if row.caller != caller:
            raise KeyReused(f"idempotency key '{key}' belongs to another caller",
                            hint="use a key of your own; keys are unique per host", idempotency_key=key)
        if row.fingerprint != fp:
            raise KeyReused(f"idempotency key '{key}' was first used for a different request",
                            hint="send the same method, path and body on a retry, or use a new key for a new "
                                 "request", idempotency_key=key)
        if row.status is not None:
            return row.id, row.nonce, (row.status, row.response)
        if leases.is_me(row.owner_boot, row.owner_pid, row.owner_started) or leases.owner_alive(
                row.owner_boot, row.owner_pid, row.owner_started):
            raise Busy(f"the request with idempotency key '{key}' is still running",
                       hint="retry in a moment to get its answer", idempotency_key=key)
        for k, v in owner.items():  # its process died mid-request: this retry takes the key over
            setattr(row, k, v)
        return row.id, row.nonce, None


__all__ = ["KeyReused", "check_key", "fingerprint", "run_once", "ttl_seconds"]
