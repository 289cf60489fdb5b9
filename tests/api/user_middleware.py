"""A user's own middleware, as ``--middleware`` imports it: an ASGI class and an async function."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class TagResponses:
    """Adds ``X-User-Middleware: class`` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-User-Middleware"] = "class"
            await send(message)

        await self.app(scope, receive, tagged)


async def stamp_path(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """FastAPI-style ``@app.middleware("http")`` function: echoes the path the app saw."""
    response = await call_next(request)
    response.headers["X-Seen-Path"] = request.url.path
    return response
