"""Clients that go away abort their engine requests at once, streaming or not."""

from __future__ import annotations

import time
from functools import partial

import anyio
import httpx
import pytest

from tests.api.conftest import API_KEY, BackgroundServer, engine_load, wait_until_idle

pytestmark = pytest.mark.anyio

LONG = {"prompt": "Tell me a very long story.", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


async def wait_until_running(http: httpx.AsyncClient, count: int, timeout: float = 30.0) -> None:
    with anyio.fail_after(timeout):
        while (await engine_load(http))[0] < count:
            await anyio.sleep(0.05)


async def test_dropped_non_streaming_request_is_aborted(
    any_server: BackgroundServer, any_http: httpx.AsyncClient
) -> None:
    async with httpx.AsyncClient(base_url=any_server.url, headers=HEADERS) as c, anyio.create_task_group() as tg:
        tg.start_soon(partial(c.post, "/v1/completions", json=LONG))
        await wait_until_running(any_http, 1)
        tg.cancel_scope.cancel()  # the client gives up: its connection closes
    # 400 tokens would take tens of seconds; an abort frees the slot at the next step.
    assert await wait_until_idle(any_http, timeout=5.0) < 5.0


async def test_closed_stream_is_aborted(any_server: BackgroundServer, any_http: httpx.AsyncClient) -> None:
    body = {**LONG, "stream": True}
    async with (
        httpx.AsyncClient(base_url=any_server.url, headers=HEADERS) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        async for _ in r.aiter_raw():
            break  # one chunk, then hang up
    assert await wait_until_idle(any_http, timeout=5.0) < 5.0


async def test_200_abandoned_requests_then_a_prompt_answer(server: BackgroundServer, http: httpx.AsyncClient) -> None:
    limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)

    async def abandon(c: httpx.AsyncClient, i: int) -> None:
        with anyio.move_on_after(0.5 + (i % 10) * 0.1):
            if i % 2:
                await c.post("/v1/completions", json=LONG)
            else:
                async with c.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "Tell me a long story."}],
                        "max_tokens": 400,
                        "ignore_eos": True,
                        "stream": True,
                    },
                ) as r:
                    async for _ in r.aiter_raw():
                        pass

    async with (
        httpx.AsyncClient(base_url=server.url, headers=HEADERS, limits=limits, timeout=60) as c,
        anyio.create_task_group() as tg,
    ):
        for i in range(200):
            tg.start_soon(abandon, c, i)
    start = time.monotonic()
    r = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < 10.0
    await wait_until_idle(http, timeout=10.0)
