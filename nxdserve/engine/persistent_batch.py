"""Persistent batch: per-slot arrays that live for the whole engine and change by diffs.

A slot is one KV-cache line (an NxD ``seq_id``). A request owns its slot from admission to finish or
abort. The backend owns the batch and is its only writer, in its own thread: ``apply`` takes the diffs a
``StepPlan`` carries (freed slots, new requests, drafts) at the start of a step, ``append_sampled`` the
step's tokens at its end (see nxdserve/engine/step.py). Backends, the sampler and the proposers read these
arrays with vectorised numpy/torch code, so the per-step cost of steady-state decode does not grow with
Python work per request.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nxdserve.engine.step import StepPlan
from nxdserve.sampling_params import SamplingParams


class PersistentBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_spec_tokens: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        s = max_num_seqs
        # Room for drafts past max_model_len is never used for KV (the scheduler clamps), but keeps
        # the writes of draft token ids branch-free.
        self.token_ids = np.zeros((s, max_model_len + max_spec_tokens + 1), dtype=np.int64)
        self.num_tokens = np.zeros(s, dtype=np.int32)  # prompt + output, drafts excluded
        self.num_prompt_tokens = np.zeros(s, dtype=np.int32)
        self.active = np.zeros(s, dtype=bool)
        self.request_ids: list[str | None] = [None] * s

        # Sampling parameters, one row per slot.
        self.temperature = np.ones(s, dtype=np.float32)
        self.top_p = np.ones(s, dtype=np.float32)
        self.top_k = np.zeros(s, dtype=np.int32)  # 0: disabled
        self.min_p = np.zeros(s, dtype=np.float32)
        self.presence_penalty = np.zeros(s, dtype=np.float32)
        self.frequency_penalty = np.zeros(s, dtype=np.float32)
        self.repetition_penalty = np.ones(s, dtype=np.float32)
        self.num_logprobs = np.full(s, -1, dtype=np.int32)  # -1: not requested
        self.num_prompt_logprobs = np.full(s, -1, dtype=np.int32)
        self.min_tokens = np.zeros(s, dtype=np.int32)
        # Slots whose token is a plain argmax: greedy, no logprobs, no logit bias, penalties or min-tokens stop
        # ids. Set at admission with the arrays above (nothing else writes them), so that a step of such rows
        # needs no per-row gathers in the sampler (Sampler.sample).
        self.plain_greedy = np.zeros(s, dtype=bool)
        # Ids masked until min_tokens outputs exist (eos + stop_token_ids), per slot.
        self.min_tokens_stop_ids: list[list[int]] = [[] for _ in range(s)]
        self.logit_bias: list[dict[int, float] | None] = [None] * s
        self.generators: list[torch.Generator | None] = [None] * s
        # Seeded generators of preempted requests, by request id, until they resume: a resumed request samples
        # the same sequence as one never preempted.
        self.suspended_generators: dict[str, torch.Generator] = {}
        # LoRA: the adapter buffer slot each row's tokens use (written by a LoRA-enabled backend), -1: base.
        self.lora_slot = np.full(s, -1, dtype=np.int64)
        # Images (vision-language models, written by the backend at admission): each row's encoder output and
        # multimodal positions (qwen2_vl.SlotImages), kept for the request's life; has_images marks those rows.
        self.has_images = np.zeros(s, dtype=bool)
        self.images: list[Any] = [None] * s
        # Tokens past the prompt rotate at their index + rope_delta (M-RoPE's offset; 0 for text prompts).
        self.rope_delta = np.zeros(s, dtype=np.int64)
        # Bumped whenever a slot is added or removed; backends cache derived tensors against it.
        self.version = 0

    # -- diffs, applied by the owning backend --------------------------------------------------------
    def apply(self, plan: StepPlan) -> None:
        """Bring the batch up to ``plan``: free, then admit (a slot may be freed and taken again between two
        plans), then write each drafting row's drafts after its last real token."""
        for slot in plan.preempted_slots:
            request_id, generator = self.request_ids[slot], self.generators[slot]
            if request_id is not None and generator is not None:
                self.suspended_generators[request_id] = generator
        for request_id in plan.discarded_request_ids:
            self.suspended_generators.pop(request_id, None)
        for slot in plan.freed_slots:
            self.remove(slot)
        for new in plan.new_requests:
            self.add(new.slot, new.request_id, new.prompt_token_ids, new.params, new.min_tokens_stop_ids)
            if new.resumed:
                self.resume(new.slot, new.request_id, new.output_token_ids)
        drafts = plan.draft_token_ids
        if drafts is not None:
            rows = np.flatnonzero(plan.num_drafts > 0)
            slots = plan.slots[rows]
            counts = plan.num_drafts[rows]
            cols = np.arange(drafts.shape[1])[None, :]
            take = cols < counts[:, None]
            positions = self.num_tokens[slots][:, None] + cols
            self.token_ids[np.broadcast_to(slots[:, None], take.shape)[take], positions[take]] = drafts[rows][take]

    def append_sampled(self, slots: np.ndarray, token_ids: np.ndarray, num_sampled: np.ndarray) -> None:
        """A step's tokens: row r of ``token_ids`` (R, W) holds ``num_sampled[r]`` tokens for ``slots[r]``."""
        if token_ids.shape[1] == 1 and bool(num_sampled.all()):  # one token a row (plain decodes): no masks
            self.token_ids[slots, self.num_tokens[slots]] = token_ids[:, 0]
            self.num_tokens[slots] += 1
            return
        if not num_sampled.any():
            return
        cols = np.arange(token_ids.shape[1])[None, :]
        take = cols < num_sampled[:, None]
        positions = self.num_tokens[slots].astype(np.int64)[:, None] + cols
        self.token_ids[np.broadcast_to(slots[:, None], take.shape)[take], positions[take]] = token_ids[take]
        self.num_tokens[slots] += num_sampled.astype(np.int32)

    def add(
        self,
        slot: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop_ids_for_min_tokens: list[int],
    ) -> None:
        # A slot still marked active is overwritten: its free was in a plan whose step failed before the
        # backend applied it, and the new request replaces whatever it held.
        n = len(prompt_token_ids)
        self.token_ids[slot, :n] = prompt_token_ids
        self.num_tokens[slot] = n
        self.num_prompt_tokens[slot] = n
        self.active[slot] = True
        self.request_ids[slot] = request_id
        self.lora_slot[slot] = -1
        self.has_images[slot] = False
        self.images[slot] = None
        self.rope_delta[slot] = 0
        self.temperature[slot] = 0.0 if params.is_greedy else params.temperature
        self.top_p[slot] = params.top_p
        self.top_k[slot] = params.top_k
        self.min_p[slot] = params.min_p
        self.presence_penalty[slot] = params.presence_penalty
        self.frequency_penalty[slot] = params.frequency_penalty
        self.repetition_penalty[slot] = params.repetition_penalty
        self.num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[slot] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self.min_tokens[slot] = params.min_tokens
        self.min_tokens_stop_ids[slot] = stop_ids_for_min_tokens if params.min_tokens > 0 else []
        self.logit_bias[slot] = dict(params.logit_bias) if params.logit_bias else None
        self.generators[slot] = (
            torch.Generator().manual_seed(params.seed % (2**63)) if params.seed is not None else None
        )
        self.plain_greedy[slot] = (
            params.is_greedy
            and params.logprobs is None
            and not params.logit_bias
            and not params.needs_penalties
            and not self.min_tokens_stop_ids[slot]
        )
        self.version += 1

    def resume(self, slot: int, request_id: str, output_token_ids: list[int]) -> None:
        """After ``add``: a preempted request's generated tokens follow its prompt, its prompt logprobs are not
        computed again, and its seeded generator continues where it was."""
        self.append(slot, output_token_ids)
        self.num_prompt_logprobs[slot] = -1
        generator = self.suspended_generators.pop(request_id, None)
        if generator is not None:
            self.generators[slot] = generator

    def remove(self, slot: int) -> None:
        self.active[slot] = False
        self.plain_greedy[slot] = False
        self.request_ids[slot] = None
        self.num_tokens[slot] = 0
        self.num_prompt_tokens[slot] = 0
        self.generators[slot] = None
        self.logit_bias[slot] = None
        self.min_tokens_stop_ids[slot] = []
        self.lora_slot[slot] = -1
        self.has_images[slot] = False
        self.images[slot] = None  # frees the encoder output
        self.rope_delta[slot] = 0
        self.version += 1

    def append(self, slot: int, token_ids: list[int]) -> None:
        start = int(self.num_tokens[slot])
        self.token_ids[slot, start : start + len(token_ids)] = token_ids
        self.num_tokens[slot] = start + len(token_ids)

    # -- views read by backends --------------------------------------------------------------------
    def num_output_tokens(self, slots: np.ndarray) -> np.ndarray:
        return self.num_tokens[slots] - self.num_prompt_tokens[slots]
