"""Shared request dependencies: the Service behind the app, and the Idempotency-Key header."""

from __future__ import annotations

from fastapi import Header, Request

from vgpumgr.errors import InvalidInput
from vgpumgr.service import Service


def service(request: Request) -> Service:
    return request.app.state.service


def idempotency_key(key: str | None = Header(default=None, alias="Idempotency-Key", max_length=128,
                                             description="a retried request with the same key gets the same result"),
                    ) -> str | None:
    if key is None:
        return None
    key = key.strip()
    if not key or not key.isprintable():
        raise InvalidInput("the Idempotency-Key header is empty or has control characters",
                           hint="send 1-128 printable characters, the same on every retry of one request")
    return key
