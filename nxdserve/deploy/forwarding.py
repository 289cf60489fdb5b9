"""One HTTP request carried to another process and played into nxdserve's own ASGI app there.

A Ray Serve ingress receives the HTTP request, packs it as a ForwardedRequest (with the prompt or messages
lifted out of the JSON body, which is what Ray's prefix-aware router reads to pick a replica) and calls an
engine replica through a streaming handle; the replica plays it into the app (``play``) and streams back the
response's start and body chunks. The app is the same Starlette app ``nxdserve`` serves, so every route,
status code and error envelope is the same on Ray as on one server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)
ResponseStart = tuple[int, list[tuple[bytes, bytes]]]


@dataclass
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    # The body's "prompt" or "messages", for ray.serve.llm's PrefixCacheAffinityRouter: it takes the first of
    # ``messages`` / ``prompt`` that the object *has* (hasattr), so only the one the body holds is an attribute.
    routing_text: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        text = self.__dict__.get("routing_text", {})
        if name in text:
            return text[name]
        raise AttributeError(name)

    @classmethod
    def build(cls, method: str, path: str, query_string: bytes, headers: list[tuple[bytes, bytes]],
              body: bytes) -> ForwardedRequest:
        routing_text: dict[str, Any] = {}
        if method == "POST" and body:
            try:
                data = json.loads(body)
            except ValueError:
                data = None  # the app answers the 400
            if isinstance(data, dict):
                routing_text = {k: data[k] for k in ("messages", "prompt") if data.get(k) is not None}
        return cls(method, path, query_string, headers, body, routing_text)


async def play(app: Any, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``app`` on ``request``: yields the response start (status, headers) once, then body chunks. Closing
    the iterator early tells the app the client went away (it aborts the request's engine work)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
        "query_string": request.query_string, "root_path": "", "headers": request.headers,
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
    }
    events: asyncio.Queue[ResponseStart | bytes | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            events.put_nowait((message["status"], list(message.get("headers", []))))
        elif message["type"] == "http.response.body" and message.get("body"):
            events.put_nowait(bytes(message["body"]))

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            events.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (event := await events.get()) is not None:
            yield event
        with contextlib.suppress(Exception):  # the app answered a 500 already and logged it
            await task
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=5.0)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
