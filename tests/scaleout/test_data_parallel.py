"""--data-parallel-size 2 on the default model: two engine processes behind one API server. Streaming, abort,
/health and /metrics through the processes, load spreading, and an engine process killed mid-stream.

Slow (two model loads plus a restart: 4-5 minutes on this shared 2-core machine); the pieces without a model
are in test_dp_units.py in the default suite."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator

import anyio
import httpx
import pytest

from nxdserve.api.server import BackgroundServer
from nxdserve.engine.dp.client import DataParallelEngine
from tests.api.conftest import sse_events, start_server

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

LONG = {"prompt": "Count to a thousand:", "max_tokens": 200, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def dp_server() -> Iterator[BackgroundServer]:
    server = start_server(data_parallel_size=2, max_num_seqs=4, max_model_len=256, served_model_name=["dp"])
    yield server
    server.stop()


@pytest.fixture
async def http(dp_server: BackgroundServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=dp_server.url, timeout=120) as c:
        yield c


def dp_engine(server: BackgroundServer) -> DataParallelEngine:
    assert isinstance(server.engine, DataParallelEngine)
    return server.engine


async def wait_for(predicate: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out waiting"
        await anyio.sleep(0.05)


async def stream_text(http: httpx.AsyncClient, body: dict[str, object]) -> list[str]:
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200
    return sse_events(r.text)


async def test_engines_run_in_their_own_processes_on_their_own_cores(dp_server: BackgroundServer) -> None:
    engine = dp_engine(dp_server)
    pids = {h.facts.pid for h in engine.handles if h.facts}
    assert len(pids) == 2 and os.getpid() not in pids
    cpus = [h.placement.cpus for h in engine.handles]
    assert cpus[0] and cpus[1] and not set(cpus[0]) & set(cpus[1])
    for handle in engine.handles:
        assert set(os.sched_getaffinity(handle.facts.pid)) == set(handle.placement.cpus)  # type: ignore[union-attr]


async def test_completion_streaming_and_validation(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    events = await stream_text(http, {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True})
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == r.json()["choices"][0]["text"]  # greedy: the same text whichever engine ran it
    # Refused before any engine sees it, with the param named, as with one engine.
    r = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 10_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert (await http.get("/health")).status_code == 200


async def test_load_spreads_and_metrics_label_each_engine(dp_server: BackgroundServer, http: httpx.AsyncClient) -> None:
    engine = dp_engine(dp_server)
    seen: list[list[int]] = []

    async def one() -> None:
        await stream_text(http, {**LONG, "max_tokens": 20})

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(one)
        await anyio.sleep(0.3)
        seen.append(engine.outstanding())
    assert max(seen[0]) - min(seen[0]) <= 1, seen  # least outstanding requests: 6 in flight split 3/3
    await anyio.sleep(0.6)  # the engines report their metrics every 0.25 s
    text = (await http.get("/metrics")).text
    for index in ("0", "1"):
        assert f'vllm:num_requests_running{{engine="{index}",model_name="dp"}}' in text, text[:2000]
        generated = [line for line in text.splitlines()
                     if line.startswith("vllm:generation_tokens_total{") and f'engine="{index}"' in line]
        assert generated and float(generated[0].split()[-1]) > 0


async def test_abort_frees_the_engine(dp_server: BackgroundServer, http: httpx.AsyncClient) -> None:
    engine = dp_engine(dp_server)
    async with http.stream("POST", "/v1/completions", json=LONG) as r:
        async for _ in r.aiter_lines():
            break  # the client goes away after the first frame
    await wait_for(lambda: sum(engine.outstanding()) == 0, 30)
    await wait_for(lambda: engine.stats().num_running == 0, 30)


async def test_killed_engine_ends_its_streams_with_an_error_and_is_restarted(
    dp_server: BackgroundServer, http: httpx.AsyncClient
) -> None:
    engine = dp_engine(dp_server)
    victim = engine.handles[0]
    old_pid = victim.facts.pid  # type: ignore[union-attr]
    results: list[list[str]] = []

    async def one() -> None:
        results.append(await stream_text(http, LONG))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(one)
        await wait_for(lambda: engine.outstanding() == [2, 2] and engine.stats().num_running == 4, 60)
        os.kill(old_pid, signal.SIGKILL)
    errors = [r for r in results if any('"error"' in e for e in r)]
    completed = [r for r in results if not any('"error"' in e for e in r)]
    assert len(errors) == 2 and len(completed) == 2
    for events in errors:
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "data-parallel engine 0 died" in error["message"]
    # New requests go to the surviving engine while the dead one restarts.
    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(one)
    assert all(not any('"error"' in e for e in r) for r in results[-4:])
    assert (await http.get("/health")).status_code == 200
    await wait_for(lambda: victim.ready, 180)
    assert victim.restarts == 1 and victim.facts.pid != old_pid  # type: ignore[union-attr]
    events = await stream_text(http, {**LONG, "max_tokens": 4})
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
