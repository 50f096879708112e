"""Request guards: Host check (DNS rebinding), Origin check, bearer key and body size limit.

One pure-ASGI middleware in front of everything, so a refused request never reaches a route.
CORS headers themselves come from Starlette's CORSMiddleware, fed with `cors_origin_regex`.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localpaged.server.errors import error_body

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

# Loopback web origins and VS Code webviews (`vscode-webview://<id>`, `vscode-file://vscode-app`).
LOOPBACK_ORIGIN_RE = (
    r"https?://(?:(?:[a-z0-9-]+\.)*localhost|127(?:\.\d{1,3}){3}|\[::1\])(?::\d{1,5})?"
    r"|vscode-webview://[a-z0-9.-]+|vscode-file://[a-z0-9.-]+"
)

# Paths a health check may reach without the bearer key.
PUBLIC_PATHS = frozenset({"/", "/api/version"})


def cors_origin_regex(extra_origins: Iterable[str] = ()) -> str:
    """The regex of allowed CORS origins: loopback, editor webviews and the configured ones."""
    parts = [LOOPBACK_ORIGIN_RE, *(re.escape(o.rstrip("/").lower()) for o in extra_origins)]
    return "(?:" + "|".join(parts) + ")"


def host_name(host_header: str) -> str:
    """The host part of a Host header value, lowercased, without port or IPv6 brackets."""
    value = host_header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def is_loopback_host(name: str) -> bool:
    """localhost, *.localhost, or a loopback IP literal."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class GuardMiddleware:
    """Refuse requests with a foreign or empty Host, a foreign Origin, a missing or wrong bearer
    key, or a body over the size limit. Everything else passes through unchanged.

    `allow_ip_hosts` also accepts any IP literal as Host (for a server bound to a LAN address:
    DNS rebinding needs a host *name*, so IP literals cannot carry it)."""

    def __init__(self, app: ASGIApp, *, allowed_hosts: Iterable[str] = (),
                 allowed_origins: Iterable[str] = (), api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 allow_ip_hosts: bool = False) -> None:
        self.app = app
        self.allow_ip_hosts = allow_ip_hosts
        self.allowed_hosts = {host_name(h) for h in allowed_hosts if h}
        self.origin_re = re.compile(cors_origin_regex(allowed_origins))
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes

    def host_allowed(self, host_header: str) -> bool:
        """Whether a request's Host header names this server (never an empty one)."""
        name = host_name(host_header)
        if not name:
            return False
        if is_loopback_host(name) or name in self.allowed_hosts or "*" in self.allowed_hosts:
            return True
        return self.allow_ip_hosts and _is_ip(name)

    def origin_allowed(self, origin: str) -> bool:
        return self.origin_re.fullmatch(origin.rstrip("/").lower()) is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope.get("path", "/")
        if not self.host_allowed(headers.get("host", "")):
            await _refuse(send, path, 403, "Host header not allowed (DNS rebinding protection); "
                          "pass --allowed-host to accept it")
            return
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin):
            await _refuse(send, path, 403, f"origin {origin!r} is not allowed; "
                          "pass --allowed-origin to accept it")
            return
        if (self.api_key and scope["method"] != "OPTIONS" and path not in PUBLIC_PATHS
                and not _key_ok(headers.get("authorization", ""), self.api_key)):
            await _refuse(send, path, 401, "missing or invalid API key (Authorization: Bearer ...)",
                          extra=[(b"www-authenticate", b"Bearer")])
            return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await _refuse(send, path, 413, f"request body larger than {self.max_body_bytes} bytes")
            return
        body = await _read_body(receive, self.max_body_bytes)
        if body is None:
            await _refuse(send, path, 413, f"request body larger than {self.max_body_bytes} bytes")
            return
        await self.app(scope, _replay(body, receive), send)


def _key_ok(authorization: str, key: str) -> bool:
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None when it passes `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields the buffered body once, then waits on the real one (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(send: Send, path: str, status: int, message: str,
                  extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(path, status, message)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
