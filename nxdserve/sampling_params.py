"""Per-request generation parameters, with vLLM's names, defaults and validation."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import TYPE_CHECKING

from nxdserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from nxdserve.engine.structured.spec import StructuredOutputsParams

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
GREEDY_EPS = 1e-5  # temperatures below it are greedy (the batch stores 0.0 for them); the one definition
TOP_K_ALL = 2**31 - 1  # top_k at or above every vocabulary size: no top-k truncation


class OutputKind(enum.Enum):
    DELTA = "delta"  # each output carries only what is new since the previous one
    CUMULATIVE = "cumulative"  # each output carries everything generated so far
    FINAL_ONLY = "final_only"  # one output, when the request finishes


# The numeric fields ``validate`` checks the type of (None allowed where the field's default is None)
# (numbers.Integral / Real: numpy's scalars count too)
_NUMBER_FIELDS: dict[str, type] = {
    "n": Integral, "temperature": Real, "top_p": Real, "top_k": Integral, "min_p": Real, "presence_penalty": Real,
    "frequency_penalty": Real, "repetition_penalty": Real, "seed": Integral, "max_tokens": Integral,
    "min_tokens": Integral, "logprobs": Integral, "prompt_logprobs": Integral, "truncate_prompt_tokens": Integral,
}


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's default: each output holds the whole text so far (``final.outputs[0].text`` is all of it); the API
    # layer streams deltas.
    output_kind: OutputKind = OutputKind.CUMULATIVE
    # Constrained decoding (nxdserve.engine.structured): the output follows this schema, regex, choice or grammar.
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words that must not be generated
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: max_model_len)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        # Any k beyond every vocabulary keeps every token: held to one the per-slot int arrays can store.
        self.top_k = min(self.top_k, TOP_K_ALL)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int | None = None, max_logprobs: int = 20) -> None:
        """Raise InvalidRequestError naming the first bad field."""

        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        for name, kind in _NUMBER_FIELDS.items():  # an embedding app's "0.5" is a typed error, not a TypeError
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
                wanted = "an integer" if kind is Integral else "a number"
                raise bad(name, f"{name} must be {wanted}, got {type(value).__name__} {value!r}.")

        if self.n < 1:
            raise bad("n", f"n must be at least 1, got {self.n}.")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"temperature must be in [0, 100], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise bad("top_k", f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(
                "frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}."
            )
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad(
                "repetition_penalty", f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}."
            )
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise bad("seed", f"seed must be a 64-bit integer, got {self.seed}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.",
            )
        if any(s == "" for s in self.stop):
            raise bad("stop", "stop cannot contain an empty string.")
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None and not 0 <= value <= max_logprobs:
                raise bad(name, f"{name} must be in [0, {max_logprobs}], got {value}.")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids", "allowed_token_ids must not be empty.")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise bad("truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or at least 0, got "
                      f"{self.truncate_prompt_tokens}.")
        if vocab_size is not None:
            for tid in self.allowed_token_ids or []:
                if not 0 <= tid < vocab_size:
                    raise bad("allowed_token_ids", f"allowed token id {tid} is out of vocabulary (size {vocab_size}).")
            for tid in self.stop_token_ids:
                if not 0 <= tid < vocab_size:
                    raise bad("stop_token_ids", f"stop token id {tid} is out of vocabulary (size {vocab_size}).")
            for tid, bias in (self.logit_bias or {}).items():
                if not 0 <= int(tid) < vocab_size:
                    raise bad("logit_bias", f"logit_bias token id {tid} is out of vocabulary.")
                if not -100.0 <= bias <= 100.0:
                    raise bad("logit_bias", f"logit_bias values must be in [-100, 100], got {bias}.")
