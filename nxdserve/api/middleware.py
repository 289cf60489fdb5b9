"""Pure-ASGI middleware (BaseHTTPMiddleware would buffer streams and hide disconnects)."""

from __future__ import annotations

import secrets

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nxdserve.api.errors import APIError

GUARDED_PREFIXES = ("/v1",)  # vLLM guards /v1 only: /health, /metrics, /tokenize stay open


class RequestIdMiddleware:
    """Honour the client's X-Request-Id (kept in ``scope["state"]`` for the handlers) and echo it
    on every response, errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or None
        scope.setdefault("state", {})["client_request_id"] = request_id
        if request_id is None:  # nothing to echo: no wrapper between every streamed chunk and the socket
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start" and request_id is not None:
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on /v1/*; 401 in the error envelope otherwise."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(GUARDED_PREFIXES):
            given = Headers(scope=scope).get("authorization", "").encode()
            # Constant-time comparison: the key must not leak through response timing.
            if not secrets.compare_digest(given, self.expected):
                response = APIError("Unauthorized", status=401).response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
