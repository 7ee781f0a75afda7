"""Bearer tokens with roles, stored as the sha256 of a random secret.

The table is declared on vgpumgr's shared metadata so Alembic sees it; migration 0002 creates it.
Queries use SQLAlchemy Core: a token check is one indexed SELECT.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import CheckConstraint, Column, Engine, Integer, String, Table, UniqueConstraint, insert, select, update

from vgpumgr.config import Config
from vgpumgr.db.models import Base, UTCDateTime, utcnow
from vgpumgr.db.session import get_engine, reading
from vgpumgr.errors import Conflict, InvalidInput, NotFound

ADMIN, OPERATOR, HOOK, AUDITOR = "admin", "operator", "hook", "auditor"
ROLES = (ADMIN, OPERATOR, HOOK, AUDITOR)
PREFIX = "vgm_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

api_tokens = Table(
    "api_tokens",
    Base.metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(64), nullable=False),
    Column("role", String(16), nullable=False),
    Column("secret_sha256", String(64), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("revoked_at", UTCDateTime),
    UniqueConstraint("name", name="uq_api_tokens_name"),
    UniqueConstraint("secret_sha256", name="uq_api_tokens_secret"),
    CheckConstraint("role IN ('admin', 'operator', 'hook', 'auditor')", name="ck_api_tokens_role"),
)


@dataclass(frozen=True)
class Token:
    name: str
    role: str

    @property
    def actor(self) -> str:
        return f"token:{self.name}"


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def check_role(role: str) -> str:
    if role not in ROLES:
        raise InvalidInput(f"'{role}' is not a token role", hint=f"use one of {', '.join(ROLES)}")
    return role


def _engine(cfg_or_engine: Config | Engine) -> Engine:
    if isinstance(cfg_or_engine, Engine):
        return cfg_or_engine
    from vgpumgr.service import ensure_schema

    ensure_schema(cfg_or_engine.db_url)
    return get_engine(cfg_or_engine.db_url)


def create_token(cfg: Config | Engine, name: str, role: str) -> str:
    """Make a token and return its secret: the only time it is ever shown."""
    if not _NAME.match(name or ""):
        raise InvalidInput(f"'{name}' is not a usable token name",
                           hint="use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    check_role(role)
    secret = PREFIX + secrets.token_urlsafe(32)
    with _engine(cfg).begin() as conn:
        taken = conn.execute(select(api_tokens.c.id).where(api_tokens.c.name == name)).first()
        if taken is not None:
            raise Conflict(f"a token named '{name}' already exists",
                           hint="pick another name, or revoke the old one first (`vgpumgr token revoke NAME`)")
        conn.execute(insert(api_tokens).values(name=name, role=role, secret_sha256=digest(secret),
                                               created_at=utcnow(), revoked_at=None))
    return secret


def list_tokens(cfg: Config | Engine, include_revoked: bool = False) -> list[dict[str, Any]]:
    """Name, role and dates of each token (never the secret or its hash)."""
    stmt = select(api_tokens.c.name, api_tokens.c.role, api_tokens.c.created_at, api_tokens.c.revoked_at)
    if not include_revoked:
        stmt = stmt.where(api_tokens.c.revoked_at.is_(None))
    with _engine(cfg).connect() as conn:
        rows = conn.execute(stmt.order_by(api_tokens.c.id)).all()
    return [{"name": r.name, "role": r.role, "created_at": r.created_at.isoformat(),
             "revoked_at": r.revoked_at.isoformat() if r.revoked_at else None} for r in rows]


def revoke_token(cfg: Config | Engine, name: str) -> None:
    """Revoke a token by name; its row stays so the name keeps meaning what it meant in the audit trail.
    This process forgets it at once; a running service within LOOKUP_TTL seconds."""
    _seen.clear()
    with _engine(cfg).begin() as conn:
        done = conn.execute(update(api_tokens).where(api_tokens.c.name == name, api_tokens.c.revoked_at.is_(None))
                            .values(revoked_at=utcnow())).rowcount
    if not done:
        raise NotFound(f"no active token named '{name}'", hint="`vgpumgr token list` shows the tokens")


LOOKUP_TTL = 2.0  # seconds a positive lookup is remembered: a revocation elsewhere applies within this
_seen: dict[str, tuple[float, Token]] = {}


def lookup(engine: Engine, secret: str) -> Token | None:
    """The active token whose secret this is, or None. Known tokens are remembered for LOOKUP_TTL seconds,
    so a busy hook does not cost a database round trip per request."""
    if not secret or len(secret) > 256:
        return None
    key = digest(secret)
    hit = _seen.get(key)
    now = time.monotonic()
    if hit and now - hit[0] < LOOKUP_TTL:
        return hit[1]
    with reading(engine) as conn:
        row = conn.execute(select(api_tokens.c.name, api_tokens.c.role)
                           .where(api_tokens.c.secret_sha256 == key, api_tokens.c.revoked_at.is_(None))).first()
    if row is None:
        _seen.pop(key, None)
        return None
    token = Token(row.name, row.role)
    _seen[key] = (now, token)
    return token
