"""Pure-ASGI middleware (BaseHTTPMiddleware would buffer streams and hide disconnects; only a user's
--middleware function is wrapped in it, as FastAPI's ``@app.middleware("http")`` does)."""

from __future__ import annotations

import importlib
import inspect
import secrets
from collections.abc import Sequence
from typing import Protocol, TypeGuard

from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nxdserve.api.errors import APIError
from nxdserve.errors import ConfigError


class _MiddlewareClass(Protocol):
    """An ASGI middleware class: called with the app it wraps, it is an ASGI app itself."""

    def __call__(self, app: ASGIApp, /) -> ASGIApp: ...


def _is_middleware_class(target: object) -> TypeGuard[_MiddlewareClass]:
    return inspect.isclass(target)


GUARDED_PREFIXES = ("/v1",)  # vLLM guards /v1 only: /health, /metrics, /tokenize stay open


def route_path(scope: Scope) -> str:
    """The path the routes see: uvicorn puts --root-path in front of the request path."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def load_user_middleware(import_path: str) -> Middleware:
    """--middleware: ``module.attr`` naming an ASGI middleware class (wrapped around the app as is) or an
    async function ``(request, call_next) -> response`` (as FastAPI's ``@app.middleware("http")``)."""
    module_name, _, attr = import_path.rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"--middleware {import_path!r}: cannot import it: {exc}") from exc
    if _is_middleware_class(target):
        return Middleware(target)
    if inspect.iscoroutinefunction(target):
        return Middleware(BaseHTTPMiddleware, dispatch=target)
    raise ConfigError(f"--middleware {import_path!r}: not a class or an async function.")


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
    """``Authorization: Bearer <key>`` on /v1/* (any of the keys); 401 in the error envelope otherwise.
    The path is matched below --root-path, so a proxy prefix does not unguard the routes."""

    def __init__(self, app: ASGIApp, api_key: str | Sequence[str]) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        self.expected = [f"Bearer {key}".encode() for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and route_path(scope).startswith(GUARDED_PREFIXES)
        ):
            given = Headers(scope=scope).get("authorization", "").encode()
            # Constant-time comparisons, each key checked: the keys must not leak through response timing.
            matches = [secrets.compare_digest(given, expected) for expected in self.expected]
            if not any(matches):
                response = APIError("Unauthorized", status=401).response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
