"""Real servers for the API tests: the default model behind uvicorn on a free loopback port, one per
scheduling mode, each in a background thread with its own event loop (session-scoped: loading the
model dominates the cost)."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest
from openai import AsyncOpenAI

from nxdserve.api.server import BackgroundServer, ServeOptions
from nxdserve.config import EngineConfig

API_KEY = "test-key"
MODEL_NAME = "smol"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8


def engine_config(**overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "model": None,
        "backend": "torch",
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": MAX_NUM_SEQS,
        "served_model_name": [MODEL_NAME, "smol-alias"],
    }
    settings.update(overrides)
    return EngineConfig(**settings)


def start_server(api_key: str | None = None, **overrides: Any) -> BackgroundServer:
    opts = ServeOptions(
        host="127.0.0.1", port=0, api_key=api_key, log_requests=False, log_level="warning", drain_timeout=5.0
    )
    return BackgroundServer(engine_config(**overrides), opts).start()


@pytest.fixture(scope="session")
def chunked_server() -> Iterator[BackgroundServer]:
    """Chunked prefill, guarded by API_KEY (every client below sends it)."""
    server = start_server(api_key=API_KEY, enable_chunked_prefill=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def prefill_first_server() -> Iterator[BackgroundServer]:
    server = start_server(api_key=API_KEY, enable_chunked_prefill=False)
    yield server
    server.stop()


@pytest.fixture
def server(chunked_server: BackgroundServer) -> BackgroundServer:
    return chunked_server


@pytest.fixture(params=["chunked", "prefill-first"])
def any_server(request: pytest.FixtureRequest) -> BackgroundServer:
    """For the behaviours that must hold in both scheduling modes."""
    name = "chunked_server" if request.param == "chunked" else "prefill_first_server"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def _openai(server: BackgroundServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
async def client(server: BackgroundServer) -> AsyncIterator[AsyncOpenAI]:
    async with _openai(server) as c:
        yield c


@pytest.fixture
async def any_client(any_server: BackgroundServer) -> AsyncIterator[AsyncOpenAI]:
    async with _openai(any_server) as c:
        yield c


@pytest.fixture
async def http(server: BackgroundServer) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120) as c:
        yield c


@pytest.fixture
async def any_http(any_server: BackgroundServer) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=any_server.url, headers=headers, timeout=120) as c:
        yield c


def sse_events(body: str) -> list[str]:
    """Split an SSE body into its ``data:`` payloads, checking the framing on the way."""
    assert body.endswith("\n\n"), "every frame ends with a blank line"
    frames = body.split("\n\n")[:-1]
    for frame in frames:
        assert frame.startswith("data: "), frame
    return [frame[len("data: ") :] for frame in frames]


def gauge(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


async def engine_load(http: httpx.AsyncClient) -> tuple[float, float, float]:
    text = (await http.get("/metrics")).text
    return (
        gauge(text, "vllm:num_requests_running"),
        gauge(text, "vllm:num_requests_waiting"),
        gauge(text, "vllm:kv_cache_usage_perc"),
    )


async def wait_until_idle(http: httpx.AsyncClient, timeout: float) -> float:
    """Seconds until running, waiting and KV usage are all 0; fails after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if await engine_load(http) == (0.0, 0.0, 0.0):
            return time.monotonic() - start
        await anyio.sleep(0.05)
    raise AssertionError(f"engine still busy after {timeout}s: {await engine_load(http)}")
