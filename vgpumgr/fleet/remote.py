"""Another host's vgpumgr service, as the source of a migration asks it (preflight, settle).

`Remote("unix:/run/vgpumgr/api.sock", token)` or `Remote("https://host-b:8470", token)`: JSON over HTTP with a
bearer token; a refusal comes back as the VgpuError its status names, with the other host's words in it.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from typing import Any

from vgpumgr.errors import Busy, Conflict, InvalidInput, NoCapacity, NotFound, PermissionDenied, Unavailable, VgpuError

_BY_STATUS: dict[int, type[VgpuError]] = {400: InvalidInput, 401: PermissionDenied, 403: PermissionDenied,
                                          404: NotFound, 409: Conflict, 422: InvalidInput, 423: Busy, 503: Unavailable}


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (a vgpumgr service's /run/vgpumgr/api.sock)."""

    def __init__(self, path: str, timeout: float = 30.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.unix_path)
        self.sock = s


class Remote:
    def __init__(self, url: str, token: str, timeout: float = 60.0) -> None:
        if not token or "\n" in token:
            raise InvalidInput("no usable token for the destination's vgpumgr service",
                               hint="give a token of the destination (`vgpumgr token create --role operator` there) "
                                    "with --to-token-file or VGPUMGR_TO_TOKEN")
        self.url, self.token, self.timeout = url, token.strip(), timeout
        if url.startswith("unix:"):
            self._connect = lambda: UnixHTTPConnection(url[5:], timeout)
        else:
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise InvalidInput(f"'{url}' is not a vgpumgr service address",
                                   hint="use unix:/path/to/api.sock, http://host:8470 or https://host:8470")
            cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            self._connect = lambda: cls(parts.hostname, parts.port, timeout=timeout)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        conn = self._connect()
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise Unavailable(f"the vgpumgr service at {self.url} did not answer {method} {path}: {exc}",
                              hint="is `vgpumgr serve` running there, and reachable from here?") from exc
        finally:
            conn.close()
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            payload = {"detail": raw.decode(errors="replace")[:500]}
        if resp.status >= 400:
            cls = _BY_STATUS.get(resp.status, NoCapacity if resp.status == 507 else VgpuError)
            detail = payload.get("detail") or payload.get("title") or f"HTTP {resp.status}"
            raise cls(f"{self.url}: {detail}", hint=payload.get("hint") or "")
        return payload

    def preflight(self, domain: str, xml: str) -> dict[str, Any]:
        return self.call("POST", "/v1/migrations/preflight", {"domain": domain, "xml": xml})

    def settle(self, domain: str) -> dict[str, Any]:
        return self.call("POST", "/v1/migrations/settle", {"domain": domain})
