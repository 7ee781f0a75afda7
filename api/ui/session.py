"""Who is looking at the web view: the login cookie, the CSRF token of every form, and role checks.

The cookie holds the bearer token itself (HttpOnly, SameSite=Strict; Secure on https and on loopback hosts,
where browsers keep Secure cookies even over plain http). Each request looks the token up again, so a revoked
token stops working in the browser within tokens.LOOKUP_TTL seconds. A form's CSRF token is an HMAC, under a
per-process secret, of the token's digest: it cannot be derived without the cookie and needs no server state.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import threading
from urllib.parse import parse_qsl

from fastapi import Request

from api.auth import READ
from api.tokens import ADMIN, OPERATOR, Token, digest, lookup
from vgpumgr.errors import InvalidInput, PermissionDenied, VgpuError

COOKIE = "vgpumgr_ui"
LOGIN_COOKIE = "vgpumgr_ui_login"  # double-submit token of the login form (there is no session yet)
CHANGE = (ADMIN, OPERATOR)  # may create and release vGPUs from the page
MAX_FORM_BYTES = 16 * 1024
_secret_lock = threading.Lock()


class LoginRequired(Exception):
    """No usable cookie: send the browser to the login page."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


class CsrfFailed(VgpuError):
    status = 403
    exit_code = 6
    kind = "csrf-failed"


def _app_secret(request: Request) -> bytes:
    state = request.app.state
    with _secret_lock:
        if getattr(state, "ui_secret", None) is None:
            state.ui_secret = secrets.token_bytes(32)
        return state.ui_secret


def csrf_for(request: Request, token_secret: str) -> str:
    return hmac.new(_app_secret(request), b"csrf:" + digest(token_secret).encode(), hashlib.sha256).hexdigest()


def secure_cookie(request: Request) -> bool:
    """Secure on https; also on loopback, where Chromium stores Secure cookies over http (tests/test_ui_browser.py
    proves it). On plain http to any other address a Secure cookie would be dropped and login would fail."""
    if request.url.scheme == "https":
        return True
    host = (request.url.hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def current(request: Request) -> tuple[Token, str]:
    """The logged-in token and its secret, or LoginRequired."""
    secret = request.cookies.get(COOKIE)
    if not secret:
        raise LoginRequired()
    token = lookup(request.app.state.engine, secret)
    if token is None:
        raise LoginRequired("your token is unknown or was revoked; log in again")
    return token, secret


def reader(request: Request) -> Token:
    token, secret = current(request)
    if token.role not in READ:
        raise PermissionDenied(f"token '{token.name}' has role {token.role}, which may not use the web view",
                               hint=f"log in with a token of role {' or '.join(READ)}", role=token.role)
    request.state.ui_token = token
    request.state.csrf = csrf_for(request, secret)
    return token


async def form(request: Request) -> dict[str, str]:
    """The url-encoded form of a POST (last value wins), bounded in size."""
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise InvalidInput("the form is too large", hint=f"send at most {MAX_FORM_BYTES} bytes")
    try:
        return dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True, max_num_fields=32))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidInput(f"the form could not be read: {exc}", hint="submit the page's own form") from None


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    if not origin or origin == "null":
        return origin is None
    return origin.rstrip("/") == f"{request.url.scheme}://{request.url.netloc}"


def changer(request: Request, fields: dict[str, str]) -> Token:
    """The token of a POST that changes something: logged in, allowed to change, and with a valid CSRF token."""
    token, secret = current(request)
    if token.role not in CHANGE:
        raise PermissionDenied(f"token '{token.name}' has role {token.role}, which may only read",
                               hint=f"log in with a token of role {' or '.join(CHANGE)} to change anything",
                               role=token.role)
    check_csrf(request, fields.get("csrf", ""), csrf_for(request, secret))
    request.state.ui_token = token
    request.state.csrf = csrf_for(request, secret)
    return token


def check_csrf(request: Request, sent: str, expected: str) -> None:
    if not _same_origin(request):
        raise CsrfFailed("the form was sent from another site", hint="use the form on this host's own page")
    if not sent or not hmac.compare_digest(sent.encode(), expected.encode()):
        raise CsrfFailed("the form's CSRF token is missing or stale",
                         hint="reload the page (the service may have restarted) and submit the form again")


def safe_next(value: str | None) -> str:
    """Where to go after login: only a path of this web view, never another site."""
    if value and value.startswith("/ui") and not value.startswith("//") and "\\" not in value and \
            value.isprintable() and len(value) <= 512:
        return value
    return "/ui/"
