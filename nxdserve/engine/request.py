"""Engine-side request state, with vLLM V1's accounting (num_computed_tokens catches up with tokens)."""

from __future__ import annotations

import enum
import hashlib
import time
from typing import TYPE_CHECKING

import numpy as np

from nxdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nxdserve.engine.mm_inputs import MultiModalInputs
    from nxdserve.lora.adapter import LoraAdapter


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    # Everything above RUNNING is final.
    FINISHED_STOPPED = 2
    FINISHED_LENGTH_CAPPED = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.RUNNING


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    __slots__ = (
        "arrival_time",
        "eos_token_ids",
        "first_scheduled_time",
        "lora",
        "max_tokens",
        "mm_inputs",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "output_token_ids",
        "params",
        "priority",
        "prompt_token_ids",
        "prompt_tokens_counted",
        "request_id",
        "slot",
        "spec_alt_ids",
        "spec_token_ids",
        "status",
        "stop_reason",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.max_tokens = max_tokens  # resolved: never None
        # ignore_eos drops eos from the stop set entirely (vLLM's update_from_generation_config).
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority  # --scheduling-policy priority: lower is served first (vLLM)
        self.first_scheduled_time: float | None = None
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.spec_token_ids: list[int] = []
        # Alternatives to spec_token_ids[0] (DraftAlternatives), verified in the same step or dropped.
        self.spec_alt_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV its slot already held at admission (prefix caching)
        self.num_preemptions = 0  # times it gave its slot up and went back to waiting (priority scheduling)
        # Prompt tokens already counted as prefill work: a resumed request recomputes them, uncounted.
        self.prompt_tokens_counted = 0
        self.slot: int | None = None
        self.stop_reason: int | str | None = None
        self.lora: LoraAdapter | None = None  # the adapter it runs with (host weights); None: the base model
        # The prompt's images as the processor made them (vision-language models); None: a text prompt.
        self.mm_inputs: MultiModalInputs | None = None

    @property
    def lora_name(self) -> str | None:
        return None if self.lora is None else self.lora.name

    def prefix_key_ids(self) -> np.ndarray:
        """The prompt as prefix caching compares it: token ids, with each image's tokens replaced by negative
        ids drawn from its content hash, so prompts whose tokens agree but whose images differ never match."""
        ids = np.asarray(self.prompt_token_ids, dtype=np.int64)
        mm = self.mm_inputs
        if mm is None:
            return ids
        for digest, start, count in zip(mm.image_hashes, mm.image_offsets, mm.num_image_tokens, strict=True):
            ids[start : start + count] = -1 - int(digest[:15], 16)
        if mm.cross_attention and mm.image_offsets:
            # Mllama: the text before the first image attends to every image too (transformers' full text rows
            # keep their cross-attention output), so its KV depends on all of them: key it on their hashes.
            images = int(hashlib.sha256("".join(mm.image_hashes).encode()).hexdigest()[:9], 16)  # 36 bits
            first = mm.image_offsets[0]
            # Below every image token's key (> -2**60): -2**62 - (images' 36 bits, then the token's 24).
            ids[:first] = -(2**62) - ((images << 24) | (ids[:first] & (2**24 - 1)))
        return ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """Some prompt tokens still have no KV (a partial prefill)."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def stop_ids_for_min_tokens(self) -> list[int]:
        """Ids the sampler masks until min_tokens outputs exist (vLLM's _all_stop_token_ids)."""
        return sorted(set(self.eos_token_ids) | set(self.params.stop_token_ids))

    def check_stop(self, max_model_len: int) -> bool:
        """vLLM's check_stop order, run after each appended token. Sets status; True when finished."""
        num_out = len(self.output_token_ids)
        if num_out < self.params.min_tokens:
            # vLLM would keep going here and then schedule nothing forever at the context limit.
            if self.num_tokens >= max_model_len:
                self.status = RequestStatus.FINISHED_LENGTH_CAPPED
                return True
            return False
        last = self.output_token_ids[-1]
        if last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in self.params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
            return True
        if self.num_tokens >= max_model_len or num_out >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
