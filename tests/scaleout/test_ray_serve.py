"""Ray Serve (slow; needs ``pip install nxdserve[ray]``): a local Ray cluster, two replicas of the default model
(max_num_seqs 4, one CPU each, routed by Ray's PrefixCacheAffinityRouter), 64 concurrent OpenAI SDK streams,
one replica killed mid-run. Every request either completed or ended with a clear error; the next 32 all
succeed; /metrics labels each replica."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def serve_url() -> Iterator[str]:
    from nxdserve.deploy.ray_serve import build_app

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "PYTHONPATH": os.getcwd()}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app({"max_num_seqs": 4, "max_model_len": 256, "num_replicas": 2, "num_cpus": 1,
                     "served_model_name": "smol", "drain_timeout_s": 5, "prefix_aware": True})
    serve.run(app, name="nxdserve", route_prefix="/", blocking=False)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        status = serve.status().applications.get("nxdserve")
        if status is not None and status.status == "RUNNING":
            break
        time.sleep(1)
    else:
        raise TimeoutError("the Serve application did not start")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def engine_replica_pids() -> list[int]:
    """Ray names a replica's worker process after it (``ray::...ServeReplica:<app>:NxdServeEngine...``)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if cmdline.startswith(b"ray::") and b"ServeReplica:nxdserve:NxdServeEngine" in cmdline:
            pids.append(int(entry.name))
    return pids


async def run_streams(url: str, count: int, max_tokens: int, on_progress: Any = None) -> list[str]:
    """Each request's outcome: "ok" (finish_reason seen), or "error: <message>" from the SDK."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    outcomes: list[str] = []

    async def one(i: int) -> None:
        try:
            stream = await client.completions.create(model="smol", prompt=f"Request {i}: count slowly:",
                                                     max_tokens=max_tokens, stream=True, extra_body={
                                                         "ignore_eos": True})
            finished = None
            async for chunk in stream:
                if on_progress is not None:
                    on_progress()
                finished = chunk.choices[0].finish_reason if chunk.choices else finished
            outcomes.append("ok" if finished == "length" else f"error: stream ended without finishing ({finished})")
        except Exception as exc:
            outcomes.append(f"error: {type(exc).__name__}: {exc}")

    await asyncio.gather(*(one(i) for i in range(count)))
    await client.close()
    return outcomes


def test_replica_killed_mid_run(serve_url: str) -> None:
    pids = engine_replica_pids()
    assert len(pids) == 2
    chunks = [0]
    killed: list[int] = []

    def progress() -> None:
        chunks[0] += 1
        if not killed and chunks[0] >= 100:  # both replicas are streaming by now
            killed.append(pids[0])
            os.kill(pids[0], signal.SIGKILL)

    outcomes = asyncio.run(run_streams(serve_url, 64, 48, progress))
    assert killed, "the run ended before the kill"
    errors = [o for o in outcomes if o != "ok"]
    assert len(outcomes) == 64
    assert 0 < len(errors) < 64, outcomes  # the dead replica's requests failed, the other's completed
    for error in errors:
        assert "engine replica" in error, error  # a clear error, not a hang or a truncated stream
    print(f"\n{64 - len(errors)} of 64 completed, {len(errors)} ended with: {errors[0]}")
    after = asyncio.run(run_streams(serve_url, 32, 16))
    assert after == ["ok"] * 32, after
    # Serve replaced the dead replica; /metrics covers every live replica, each labelled.
    deadline = time.monotonic() + 300
    while len(engine_replica_pids()) < 2 or killed[0] in engine_replica_pids():
        assert time.monotonic() < deadline
        time.sleep(2)
    time.sleep(3)
    text = httpx.get(f"{serve_url}/metrics", timeout=30).text
    replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("vllm:num_requests_running{")}
    assert len(replicas) >= 2, text[:1500]
