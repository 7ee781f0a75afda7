"""Errors as RFC 9457 problem+json: type, title, status, detail, plus vgpumgr's `hint` and the error's details."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vgpumgr.errors import VgpuError

MEDIA_TYPE = "application/problem+json"
TYPE_BASE = "https://vgpumgr.dev/problems/"
log = logging.getLogger("vgpumgr.api")
_TITLES = {400: "Bad request", 401: "Unauthorized", 403: "Forbidden", 404: "Not found", 405: "Method not allowed",
           409: "Conflict", 415: "Unsupported media type", 422: "Invalid request", 500: "Internal error",
           503: "Service unavailable", 504: "Timeout"}
_RESERVED = {"type", "title", "status", "detail", "instance", "hint"}


class ProblemResponse(JSONResponse):
    media_type = MEDIA_TYPE


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def problem(status: int, kind: str, detail: str, hint: str | None = None, instance: str | None = None,
            headers: dict[str, str] | None = None, **extra: Any) -> ProblemResponse:
    body: dict[str, Any] = {"type": TYPE_BASE + kind, "title": _TITLES.get(status, kind.replace("-", " ")),
                            "status": status, "detail": detail}
    if hint:
        body["hint"] = hint
    if instance:
        body["instance"] = instance
    for k, v in extra.items():
        if k not in _RESERVED and v is not None:
            body[k] = _jsonable(v)
    return ProblemResponse(body, status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    @app.exception_handler(VgpuError)
    async def _vgpu_error(request: Request, exc: VgpuError) -> ProblemResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return problem(exc.status, exc.kind, exc.message, exc.hint, instance=request.url.path, headers=headers,
                       **exc.detail)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> ProblemResponse:
        errors = [{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
        where = "; ".join(f"{'.'.join(e['loc'][1:]) or e['loc'][0] if e['loc'] else 'request'}: {e['msg']}"
                          for e in errors[:5])
        return problem(422, "invalid-request", f"the request is not valid: {where}",
                       "fix the fields named in `errors`; /docs shows the schema", instance=request.url.path,
                       errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> ProblemResponse:
        hint = {404: "see /docs for the endpoints", 405: "see /docs for the methods this path takes"}.get(
            exc.status_code)
        kind = {401: "unauthorized", 403: "forbidden", 404: "not-found", 405: "method-not-allowed"}.get(
            exc.status_code, "http-error")
        return problem(exc.status_code, kind, str(exc.detail), hint, instance=request.url.path,
                       headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> ProblemResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return problem(500, "internal-error", f"internal error: {type(exc).__name__}: {exc}",
                       "this is a bug in vgpumgr; the service log has the traceback", instance=request.url.path)
