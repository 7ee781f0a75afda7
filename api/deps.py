"""Shared request dependencies: the Service behind the app, and the Idempotency-Key header."""

from __future__ import annotations

from fastapi import Header, Request

from vgpumgr.errors import InvalidInput
from vgpumgr.service import Service

# The dependencies are `async def`: they never block, and a plain `def` would cost each request a hop to
# the thread pool and back per dependency.


async def service(request: Request) -> Service:
    svc = request.app.state.service
    if svc.schema_problem is not None:  # the schema was contracted under this running service: say what to do
        raise svc.schema_problem
    return svc


async def idempotency_key(key: str | None = Header(default=None, alias="Idempotency-Key", max_length=128,
                                                   description="a retried request with the same key gets the same "
                                                               "result"),
                          ) -> str | None:
    if key is None:
        return None
    key = key.strip()
    if not key or not key.isprintable():
        raise InvalidInput("the Idempotency-Key header is empty or has control characters",
                           hint="send 1-128 printable characters, the same on every retry of one request")
    return key
