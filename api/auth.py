"""Bearer-token authentication and role checks.

admin: everything. operator: VMs, vGPUs, placements and reads. hook: allocate/release vGPUs of a named VM.
auditor: read-only. No token -> 401; a token whose role may not do this -> 403.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.tokens import ADMIN, AUDITOR, HOOK, OPERATOR, Token, lookup
from vgpumgr.errors import PermissionDenied, VgpuError

READ = (ADMIN, OPERATOR, AUDITOR)
VGPU_WRITE = (ADMIN, OPERATOR, HOOK)
VM_WRITE = (ADMIN, OPERATOR)
ADMIN_ONLY = (ADMIN,)

_bearer = HTTPBearer(auto_error=False, description="`vgpumgr token create --name N --role R` prints one")


class Unauthorized(VgpuError):
    status = 401
    exit_code = 5
    kind = "unauthorized"


async def current_token(request: Request,
                        creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> Token:
    """`async`: no thread-pool hop per request; the lookup is a dict hit, and a database query at most
    once per token and LOOKUP_TTL seconds."""
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise Unauthorized("this endpoint needs a bearer token",
                           hint="send `Authorization: Bearer <token>`; `vgpumgr token create` makes one")
    token = lookup(request.app.state.engine, creds.credentials)
    if token is None:
        raise Unauthorized("the bearer token is unknown or revoked",
                           hint="check the token, or make a new one with `vgpumgr token create`")
    return token


def require(*roles: str) -> Callable[..., Token]:
    allowed = tuple(roles)

    async def check(token: Token = Depends(current_token)) -> Token:
        if token.role not in allowed:
            raise PermissionDenied(f"token '{token.name}' has role {token.role}, which may not do this",
                                   hint=f"use a token with role {' or '.join(allowed)}", role=token.role)
        return token

    return check
