"""``priority`` over the OpenAI API and the embedded AsyncEngine: a 400 naming it under fcfs (as vLLM), served under
``--scheduling-policy priority``, where a better request preempts a running one without changing its output, and
an aborted preempted request leaves no slot or kept state behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from multiprocessing import Pipe

import httpx
import pytest

from nxdserve import cli
from nxdserve.api.server import BackgroundServer
from nxdserve.config import EngineConfig
from nxdserve.engine.async_engine import AsyncEngine
from nxdserve.engine.core import EngineCore
from nxdserve.engine.dp.client import DataParallelEngine
from nxdserve.engine.dp.protocol import EngineFacts
from nxdserve.errors import InvalidRequestError
from nxdserve.sampling_params import OutputKind, SamplingParams
from tests.api.conftest import API_KEY, MODEL_NAME, engine_config, start_server
from tests.helpers.tiny_model import tiny_model_path

pytestmark = pytest.mark.anyio
TINY = {"max_model_len": 128, "max_num_seqs": 1, "num_threads": 1}


def _greedy(max_tokens: int, kind: OutputKind = OutputKind.DELTA) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


@pytest.fixture(scope="module", params=["fcfs", "priority"])
def tiny_server(request: pytest.FixtureRequest) -> Iterator[BackgroundServer]:
    server = start_server(api_key=API_KEY, model=str(tiny_model_path("llama")), scheduling_policy=request.param,
                          **TINY)
    yield server
    server.stop()


@pytest.fixture
async def http(tiny_server: BackgroundServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=tiny_server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=120) as c:
        yield c


async def test_priority_field_by_policy(tiny_server: BackgroundServer, http: httpx.AsyncClient) -> None:
    policy = tiny_server.engine_config.scheduling_policy
    bodies = {
        "/v1/completions": {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3},
        "/v1/chat/completions": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
                                 "max_tokens": 3},
        "/v1/responses": {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 3},
    }
    for path, body in bodies.items():
        r = await http.post(path, json={**body, "priority": -2})
        if policy == "fcfs":
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "priority"
            assert "--scheduling-policy priority" in r.json()["error"]["message"]
        else:
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage.get("completion_tokens", usage.get("output_tokens")) == 3
        assert (await http.post(path, json={**body, "priority": 0})).status_code == 200


def test_flag_sets_the_policy() -> None:
    assert cli.plan(["--scheduling-policy", "priority"])[0].scheduling_policy == "priority"
    assert cli.plan([])[0].scheduling_policy == "fcfs"


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    config = engine_config(model=str(tiny_model_path("llama")), scheduling_policy="priority", **TINY)
    async with AsyncEngine(config) as eng:
        yield eng


def _core(engine: AsyncEngine) -> EngineCore:
    assert engine.core is not None
    return engine.core


async def _tokens(engine: AsyncEngine, prompt: str, params: SamplingParams, priority: int = 0) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(prompt, params, priority=priority):
        tokens += out.outputs[0].token_ids
    return tokens


async def _until(condition: object, what: str) -> None:
    for _ in range(2000):
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


async def test_better_request_preempts_and_the_victim_output_is_unchanged(engine: AsyncEngine) -> None:
    low_prompt, high_prompt = "Tell me a long story about the sea.", "Hi"
    low_alone = await _tokens(engine, low_prompt, _greedy(40))
    high_alone = await _tokens(engine, high_prompt, _greedy(5))
    order: list[str] = []

    async def low() -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(low_prompt, _greedy(40), priority=3):
            tokens += out.outputs[0].token_ids
            if len(tokens) == 2:
                started.set()
        order.append("low")
        return tokens

    async def high() -> list[int]:
        await started.wait()
        tokens = await _tokens(engine, high_prompt, _greedy(5), priority=-1)
        order.append("high")
        return tokens

    started = asyncio.Event()
    low_tokens, high_tokens = await asyncio.gather(low(), high())
    assert order == ["high", "low"]  # one slot: high could only finish first by preempting low
    assert _core(engine).scheduler.num_preemptions_total == 1
    assert low_tokens == low_alone and high_tokens == high_alone
    metrics = _core(engine).metrics
    assert metrics is not None
    assert metrics.num_preemptions.labels(MODEL_NAME)._value.get() == 1  # vllm:num_preemptions_total


async def test_aborting_a_preempted_request_frees_everything(engine: AsyncEngine) -> None:
    scheduler = _core(engine).scheduler
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=60, ignore_eos=True)  # its generator is kept
    low = engine.generate("Tell me a long story about the sea.", seeded, priority=3)
    await low.__anext__()
    high = asyncio.ensure_future(_tokens(engine, "Hi", _greedy(30), priority=0))
    await _until(lambda: scheduler.num_preemptions_total == 1, "the low request is preempted")
    assert [r.priority for r in scheduler.waiting] == [3]
    await low.aclose()  # the client goes away while its request waits to resume
    await _until(lambda: not scheduler.waiting, "the abort reaches the scheduler")
    assert len(await high) == 30
    await _until(lambda: not _core(engine).has_unfinished, "the engine goes idle")
    assert scheduler.num_free_slots == 1 and not scheduler.requests
    await _tokens(engine, "Hello", _greedy(2))  # a step after the abort carries its discard to the batch
    assert not _core(engine).backend.batch.suspended_generators  # type: ignore[union-attr]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_data_parallel_client_checks_and_forwards_priority(policy: str) -> None:
    """The API process of --data-parallel-size refuses as one engine would, and sends priority to the engine."""
    engine = DataParallelEngine(EngineConfig(data_parallel_size=2, scheduling_policy=policy))  # type: ignore[arg-type]
    ours, theirs = Pipe()
    handle = engine.handles[0]
    handle.facts = EngineFacts("m", "torch", 64, 63, 1000, 2, {}, 0)
    handle.conn, handle.ready = ours, True
    engine._accepting = True
    if policy == "fcfs":
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), "r1", priority=2)
        assert info.value.param == "priority" and not theirs.poll()
    else:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), "r1", priority=2)
        message = theirs.recv()
        assert (message[0], message[1], message[2], message[5]) == ("add", "r1", [1, 2, 3], 2)
