"""Running one API request as several engine requests (one per prompt and choice) and gathering
their DELTA outputs per choice.

Whatever way a request ends (finished, client gone, error, server shutdown), every engine request
it started is aborted in a ``finally``: aborting a finished request is a no-op, and this is what
guarantees no slot outlives its HTTP request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from nxdserve.api.engine_protocol import EngineClient
from nxdserve.engine.choices import abort_all, merge
from nxdserve.engine.outputs import Logprob, LogprobsList, RequestOutput
from nxdserve.engine.prompts import ProcessedPrompt
from nxdserve.errors import RequestFailedError
from nxdserve.lora.request import LoRARequest
from nxdserve.sampling_params import SamplingParams


class RequestStream(Protocol):
    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def abort(self) -> None: ...


@dataclass
class EngineCall:
    prompt: str | list[int] | ProcessedPrompt  # ProcessedPrompt: a prompt with images, processed
    params: SamplingParams
    request_id: str
    add_special_tokens: bool = True
    lora_request: LoRARequest | None = None  # when the request's model names an adapter
    priority: int = 0  # --scheduling-policy priority: lower is served first


def start_requests(engine: EngineClient, calls: Sequence[EngineCall]) -> list[RequestStream]:
    """Enqueue every call or none: if one is refused (validation, queue full), abort the ones
    already enqueued and re-raise."""
    streams: list[RequestStream] = []
    try:
        for call in calls:
            streams.append(
                engine.add_request(
                    call.prompt,
                    call.params,
                    request_id=call.request_id,
                    add_special_tokens=call.add_special_tokens,
                    lora_request=call.lora_request,
                    priority=call.priority,
                )
            )
    except BaseException:
        abort_all(streams)
        raise
    return streams


@dataclass
class ChoiceState:
    """Everything generated so far for one choice."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: LogprobsList = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def update(self, out: RequestOutput) -> None:
        if out.error is not None or (out.outputs and out.outputs[0].finish_reason == "error"):
            raise RequestFailedError(out.error or "The request failed in the engine.")
        if not self.prompt_token_ids:
            self.prompt = out.prompt
            self.prompt_token_ids = list(out.prompt_token_ids)
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = list(out.prompt_logprobs)
        if not out.outputs:
            return
        delta = out.outputs[0]
        self.text_parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        self.num_tokens = delta.cumulative_num_tokens
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


async def collect(streams: Sequence[RequestStream]) -> list[ChoiceState]:
    """Run all streams to the end (non-streaming requests). Raises RequestFailedError on the first
    engine error, aborting the others."""
    states = [ChoiceState(index=i) for i in range(len(streams))]
    outputs = merge(streams)
    try:
        async for i, out in outputs:
            states[i].update(out)
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    return states
