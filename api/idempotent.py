"""Idempotency-Key on mutating calls: the key is the caller's (the token's actor), bound to the request's
method, path and canonical JSON body. A repeat of the same request gets the first answer again (same
status and body, with `Idempotent-Replayed: true`); the key with another request or from another caller
gets 422 naming the key. The store and its expiry live in vgpumgr.ops.idempotency."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from api.tokens import Token
from vgpumgr.ops.idempotency import fingerprint
from vgpumgr.service import Service

try:
    import orjson
except ImportError:  # a venv made before orjson became a dependency: json.dumps, same bytes, slower
    orjson = None

REPLAYED = "Idempotent-Replayed"


class FastJSONResponse(JSONResponse):
    """JSONResponse encoded by orjson: the same compact UTF-8 JSON for the API's plain dicts, several times
    faster than json.dumps."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content) if orjson is not None else super().render(content)


def idempotent(request: Request, svc: Service, token: Token, key: str | None, body: BaseModel | None,
               run: Callable[[str | None], tuple[int, Any]]) -> JSONResponse:
    """Answer with `run(allocation_key)` -> (status, body), once per key; `run(None)` when no key was sent."""
    if key is None:
        status, out = run(None)
        return FastJSONResponse(out, status_code=status)
    fp = fingerprint(request.method, request.url.path, body.model_dump(mode="json") if body is not None else None)
    status, out, replayed = svc.run_once(caller=token.actor, key=key, fingerprint=fp, run=run)
    return FastJSONResponse(out, status_code=status, headers={REPLAYED: "true"} if replayed else None)
