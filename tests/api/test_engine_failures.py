"""Queue full, a failing engine step, and a dead engine loop, on a server of their own (these tests
break it on purpose)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest

from nxdserve.api.server import BackgroundServer
from tests.api.conftest import sse_events, start_server, wait_until_idle

pytestmark = pytest.mark.anyio

LONG = {"prompt": "Count to a thousand:", "max_tokens": 300, "ignore_eos": True}


@pytest.fixture(scope="module")
def fragile_server() -> Iterator[BackgroundServer]:
    server = start_server(max_num_seqs=2, max_waiting=1, served_model_name=["fragile"])
    yield server
    server.stop()


@pytest.fixture
async def fhttp(fragile_server: BackgroundServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fragile_server.url, timeout=60) as c:
        yield c


def fail_steps(server: BackgroundServer, count: int) -> None:
    """Make the next ``count`` engine steps raise, as a backend fault would."""
    core = server.engine.core

    def install() -> None:
        original = type(core).execute.__get__(core)
        remaining = [count]

        def execute(sched: Any) -> Any:
            if remaining[0] > 0:
                remaining[0] -= 1
                raise RuntimeError("injected backend failure")
            return original(sched)

        core.execute = execute

    server.call_soon(install)


async def test_queue_full_is_503_with_retry_after(fhttp: httpx.AsyncClient) -> None:
    # Room for 2 running + 1 waiting: of 6 long requests sent at once, at least 3 are refused.
    refused: list[httpx.Response] = []

    async def send() -> None:
        r = await fhttp.post("/v1/completions", json=LONG)
        if r.status_code == 503:
            refused.append(r)

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(send)
        with anyio.fail_after(60):
            while len(refused) < 3:
                await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    await wait_until_idle(fhttp, timeout=30.0)  # the abandoned ones are aborted; later tests need the room
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"] == {
            "message": r.json()["error"]["message"],
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }


async def test_engine_error_is_500(fragile_server: BackgroundServer, fhttp: httpx.AsyncClient) -> None:
    fail_steps(fragile_server, 1)
    r = await fhttp.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "InternalServerError" and "injected backend failure" in err["message"]
    # The engine keeps serving after a failed step.
    ok = await fhttp.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


async def test_engine_error_mid_stream_is_an_error_frame_then_done(
    fragile_server: BackgroundServer, fhttp: httpx.AsyncClient
) -> None:
    events: list[str] = []
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50, "stream": True, "ignore_eos": True}
    async with fhttp.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        buffer = ""
        async for piece in r.aiter_text():
            buffer += piece
            if buffer.count("\n\n") == 3 and not events:  # role chunk and two tokens: now break the engine
                events.append("armed")
                fail_steps(fragile_server, 1)
    frames = sse_events(buffer)
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == 500 and "injected backend failure" in error["message"]


async def test_dead_engine_loop_makes_health_503(fragile_server: BackgroundServer, fhttp: httpx.AsyncClient) -> None:
    # This test kills the server's engine: it must stay the last one in this module.
    assert (await fhttp.get("/health")).status_code == 200
    fail_steps(fragile_server, 1000)  # every step fails: the loop gives up after a few
    r = await fhttp.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 500
    with anyio.fail_after(10):
        while fragile_server.engine.is_healthy:
            await fhttp.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert (await fhttp.get("/health")).status_code == 503
    after = await fhttp.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert after.status_code == 503
    stream = await fhttp.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True})
    assert stream.status_code == 503
