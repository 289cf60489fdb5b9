"""What the engine hands back to callers: one RequestOutput per request per step it made progress."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated (or prompt) token: token id -> Logprob, the chosen token first.
LogprobsList = list[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str  # delta text in DELTA mode, everything so far otherwise
    token_ids: list[int]  # same convention as text
    cumulative_num_tokens: int  # output tokens generated so far, whatever the mode
    logprobs: LogprobsList | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: LogprobsList | None = None  # first entry None-equivalent: the first token has none
    error: str | None = None  # set when finish_reason == "error"
    extra: dict[str, object] = field(default_factory=dict)
