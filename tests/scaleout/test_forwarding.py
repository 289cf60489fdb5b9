"""ForwardedRequest and play(): an HTTP request carried to an engine replica and played into an ASGI app there
(nxdserve.deploy.forwarding; no Ray needed)."""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nxdserve.api.streaming import EventStreamResponse
from nxdserve.deploy.forwarding import ForwardedRequest, play

pytestmark = pytest.mark.anyio


def test_routing_text_is_an_attribute_only_when_the_body_has_it() -> None:
    completion = ForwardedRequest.build("POST", "/v1/completions", b"", [], json.dumps({"prompt": "Hi"}).encode())
    assert completion.prompt == "Hi" and not hasattr(completion, "messages")
    chat = ForwardedRequest.build("POST", "/v1/chat/completions", b"", [],
                                  json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode())
    assert chat.messages[0]["content"] == "Hi" and not hasattr(chat, "prompt")
    broken = ForwardedRequest.build("POST", "/v1/completions", b"", [], b"{not json")
    assert not hasattr(broken, "prompt") and not hasattr(broken, "messages")
    copy = pickle.loads(pickle.dumps(chat))  # it crosses processes pickled
    assert copy.messages == chat.messages and copy.body == chat.body


class _App:
    def __init__(self) -> None:
        self.closed = asyncio.Event()

        async def echo(request: Request) -> Response:
            body = await request.json()
            return JSONResponse({"got": body, "query": request.url.query}, status_code=201)

        async def stream(request: Request) -> Response:
            async def frames() -> AsyncIterator[str]:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)

            return EventStreamResponse(frames(), on_close=self.closed.set)

        self.app = Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/stream", stream)])


async def test_play_returns_the_apps_response() -> None:
    app = _App()
    request = ForwardedRequest.build("POST", "/echo", b"a=1", [(b"content-type", b"application/json")], b'{"x": 1}')
    events = [e async for e in play(app.app, request)]
    status, headers = events[0]  # type: ignore[misc]
    assert status == 201 and (b"content-type", b"application/json") in headers
    assert json.loads(b"".join(events[1:])) == {"got": {"x": 1}, "query": "a=1"}  # type: ignore[arg-type]


async def test_closing_early_is_a_client_disconnect() -> None:
    app = _App()
    events = play(app.app, ForwardedRequest.build("GET", "/stream", b"", [], b""))
    assert (await anext(events))[0] == 200  # type: ignore[index]
    assert await anext(events) == b"data: 0\n\n"
    await events.aclose()  # as when the ingress's client goes away
    await asyncio.wait_for(app.closed.wait(), 5)  # the app released its work (nxdserve aborts engine requests)


def test_importing_nxdserve_needs_no_ray() -> None:
    code = "import sys, nxdserve, nxdserve.deploy, nxdserve.deploy.forwarding; print('ray' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
