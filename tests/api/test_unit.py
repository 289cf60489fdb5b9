"""Engine-free unit tests: request conversion, logprob shapes, error mapping, SSE and disconnect
plumbing (with a tiny stand-in stream where an engine request would be)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError

from nxdserve.api.errors import APIError, from_exception, sse_error_frame
from nxdserve.api.generation import merge
from nxdserve.api.logprobs import chat_logprobs, completion_logprobs
from nxdserve.api.params import build_sampling_params, normalize_prompts
from nxdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from nxdserve.api.streaming import DONE_FRAME, EventStreamResponse, sse_frame
from nxdserve.engine.choices import child_params
from nxdserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nxdserve.errors import QueueFullError, RequestFailedError, RequestTooLongError

VOCAB = 100


def test_normalize_prompts_shapes() -> None:
    assert normalize_prompts("hi", VOCAB) == ["hi"]
    assert normalize_prompts(["a", "b"], VOCAB) == ["a", "b"]
    assert normalize_prompts([1, 2], VOCAB) == [[1, 2]]
    assert normalize_prompts([[1], [2, 3]], VOCAB) == [[1], [2, 3]]
    for empty in (None, "", [], [[]], [""]):
        with pytest.raises(APIError, match="must be provided and non-empty"):
            normalize_prompts(empty, VOCAB)  # type: ignore[arg-type]
    with pytest.raises(APIError, match="out of vocabulary"):
        normalize_prompts([1, VOCAB], VOCAB)


def test_sampling_defaults_precedence() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    req = CompletionRequest.model_validate({"prompt": "x"})
    params = build_sampling_params(req, defaults, VOCAB, 20)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 0, 7)
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 0, "max_tokens": 3})
    params = build_sampling_params(req, defaults, VOCAB, 20)
    assert (params.temperature, params.max_tokens) == (0, 3)
    plain = build_sampling_params(CompletionRequest.model_validate({"prompt": "x"}), {}, VOCAB, 20)
    assert (plain.temperature, plain.max_tokens) == (1.0, 16)  # vLLM's and OpenAI's completions default


def test_chat_token_limits_and_logprobs() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "max_completion_tokens": 4,
         "logprobs": True, "top_logprobs": 3}
    )  # fmt: skip
    params = build_sampling_params(req, {}, VOCAB, 20)
    assert (params.max_tokens, params.logprobs) == (4, 3)
    unlimited = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert build_sampling_params(unlimited, {}, VOCAB, 20).max_tokens is None  # the engine fills the rest


def test_echo_implies_prompt_logprobs_and_zero_tokens_generates_one() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "echo": True, "logprobs": 2, "max_tokens": 0})
    params = build_sampling_params(req, {}, VOCAB, 20)
    assert (params.prompt_logprobs, params.max_tokens) == (2, 1)


def test_fan_out_seeds_children() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "n": 3, "seed": 2**63 - 2})
    children = child_params(build_sampling_params(req, {}, VOCAB, 20))
    assert [c.n for c in children] == [1, 1, 1]
    assert [c.seed for c in children] == [2**63 - 2, 2**63 - 1, -(2**63)]  # wraps within int64
    two = CompletionRequest.model_validate({"prompt": "x", "n": 2})
    unseeded = child_params(build_sampling_params(two, {}, VOCAB, 20))
    assert [c.seed for c in unseeded] == [None, None]


def test_validation_error_message_keeps_pydantic_type() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "seed": 2**64})
    err = from_exception(info.value)
    assert err.status == 400 and err.param == "seed" and "less_than_equal" in err.message


def test_exception_mapping() -> None:
    assert from_exception(RequestTooLongError("too long", param="prompt")).status == 400
    full = from_exception(QueueFullError("full"))
    assert full.status == 503 and full.headers == {"Retry-After": "1"}
    assert from_exception(RequestFailedError("boom")).body()["error"]["type"] == "InternalServerError"
    frame = sse_error_frame(RequestFailedError("boom"))
    assert frame.startswith("data: ") and frame.endswith("\n\n")
    assert json.loads(frame[6:])["error"]["code"] == 500


class _Tok:
    def decode(self, ids: list[int]) -> str:
        return f"<{ids[0]}>"


def _step(chosen: int, *others: int) -> dict[int, Logprob]:
    step = {chosen: Logprob(-1.0, rank=len(others) + 1, decoded_token=f"t{chosen}")}
    for rank, tid in enumerate(others, start=1):
        step[tid] = Logprob(-0.1 * rank, rank=rank, decoded_token=f"t{tid}")
    return step


def test_completion_logprobs_shape() -> None:
    lp = completion_logprobs([5, 6], [None, _step(6, 7, 8)], num_top=2, tokenizer=_Tok(), initial_offset=3)
    assert lp.tokens == ["<5>", "t6"]
    assert lp.text_offset == [3, 6]
    assert lp.token_logprobs == [None, -1.0]
    assert lp.top_logprobs == [None, {"t6": -1.0, "t7": -0.1, "t8": -0.2}]


def test_chat_logprobs_are_ranked_top_k() -> None:
    lp = chat_logprobs([6], [_step(6, 7, 8)], num_top=2, tokenizer=_Tok())
    [tok] = lp.content or []
    assert tok.token == "t6" and tok.logprob == -1.0 and tok.bytes == list(b"t6")
    assert [t.token for t in tok.top_logprobs] == ["t7", "t8"]


def _out(rid: str, text: str, finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, text, [1], 1, finish_reason="length" if finished else None)
    return RequestOutput(rid, "p", [1], [completion], finished, RequestMetrics(arrival_time=0.0))


class _Stream:
    """Stand-in for a RequestStream: scripted outputs, with a delay per output."""

    def __init__(self, rid: str, texts: list[str], delay: float) -> None:
        self.rid, self.texts, self.delay, self.aborted = rid, texts, delay, False

    async def _gen(self) -> AsyncIterator[RequestOutput]:
        for i, text in enumerate(self.texts):
            await asyncio.sleep(self.delay)
            yield _out(self.rid, text, i == len(self.texts) - 1)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._gen()

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.anyio
async def test_merge_interleaves_and_aborts_on_close() -> None:
    streams = [_Stream("a", ["1", "2", "3"], 0.01), _Stream("b", ["x", "y"], 0.015)]
    seen = [(i, out.outputs[0].text) async for i, out in merge(streams)]
    assert [t for i, t in seen if i == 0] == ["1", "2", "3"] and [t for i, t in seen if i == 1] == ["x", "y"]
    assert all(s.aborted for s in streams)  # finished streams are released too (a no-op in the engine)
    streams = [_Stream("c", ["1"] * 100, 0.01), _Stream("d", ["1"] * 100, 0.01)]
    gen = merge(streams)
    await gen.__anext__()
    await gen.aclose()  # type: ignore[attr-defined]
    assert all(s.aborted for s in streams)


@pytest.mark.anyio
async def test_event_stream_stops_and_cleans_up_on_disconnect() -> None:
    closed: list[str] = []
    sent: list[dict[str, Any]] = []

    async def frames() -> AsyncIterator[str]:
        try:
            for i in range(1000):
                await asyncio.sleep(0.01)
                yield sse_frame({"i": i})
            yield DONE_FRAME
        finally:
            closed.append("frames")

    disconnect = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) == 4:
            disconnect.set()

    response = EventStreamResponse(frames(), on_close=lambda: closed.append("on_close"))
    await asyncio.wait_for(response({"type": "http"}, receive, send), timeout=5)
    assert closed == ["frames", "on_close"]
    assert sent[0]["type"] == "http.response.start" and len(sent) < 10
    assert sent[1]["body"] == b'data: {"i":0}\n\n'


def test_server_startup_moves_the_loaded_heap_out_of_the_collectors_reach() -> None:
    """Loading leaves ~300k long-lived objects; frozen, they are not walked by full collections while serving."""
    import gc

    from nxdserve.api.server import _freeze_startup_heap

    loaded = [[i] for i in range(1000)]  # stands in for objects the model load left behind
    assert gc.is_tracked(loaded[0])
    try:
        _freeze_startup_heap()
        assert gc.get_freeze_count() >= len(loaded)
    finally:
        gc.unfreeze()
