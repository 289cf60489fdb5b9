"""A tiny deterministic backend for scheduler tests: the 'model' emits (previous token + 1) % vocab.

It implements the real backend contract (slots, spans, drafts, sampling rows) without a neural net,
so scheduler behaviour can be checked step by step in milliseconds. It also checks the invariants
a real slot-KV backend relies on: a span never runs past max_model_len - 1, and every position before
it holds KV of the request's own tokens there (it keeps which token each position of a line was
computed for: a line keeps its KV when its slot is freed, which is what prefix caching reuses).
"""

from __future__ import annotations

import numpy as np

from nxdserve.engine.backends.base import Backend
from nxdserve.engine.step import BackendCapabilities, StepPlan, StepResult


class CountingBackend(Backend):
    name = "counting"

    def __init__(self, max_num_seqs: int, max_model_len: int, vocab_size: int = 1000, eos: int = 999,
                 **caps: object) -> None:
        self._caps = BackendCapabilities(
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_prompt_len=max_model_len - 1,
            vocab_size=vocab_size, eos_token_ids=(eos,), **caps,  # type: ignore[arg-type]
        )
        self.kv_tokens = np.full((max_num_seqs, max_model_len), -1, dtype=np.int64)  # token whose KV is there
        self.plans: list[StepPlan] = []

    @property
    def capabilities(self) -> BackendCapabilities:
        return self._caps

    def execute(self, plan: StepPlan) -> StepResult:
        batch = self.begin_step(plan)
        self.plans.append(plan)
        width = 1 + int(plan.num_drafts.max(initial=0))
        out = np.full((plan.num_rows, width), -1, dtype=np.int64)
        num = np.zeros(plan.num_rows, dtype=np.int64)
        vocab = self._caps.vocab_size
        for r in range(plan.num_rows):
            slot, start, n = int(plan.slots[r]), int(plan.start_pos[r]), int(plan.num_scheduled[r])
            assert start + n <= self._caps.max_model_len - 1, "a span ran past max_model_len - 1"
            held, own = self.kv_tokens[slot, :start], batch.token_ids[slot, :start]
            assert (held == own).all(), f"slot {slot}: a span at {start} over KV of other tokens ({held} vs {own})"
            self.kv_tokens[slot, start : start + n] = batch.token_ids[slot, start : start + n]
            if not plan.sample[r]:
                continue
            tokens = batch.token_ids[slot, start : start + n]
            drafts = int(plan.num_drafts[r])
            # Verification: target token after position p is tokens[p] + 1; accept drafts while they match.
            first = n - 1 - drafts
            accepted = 0
            while accepted < drafts and tokens[first + accepted + 1] == (tokens[first + accepted] + 1) % vocab:
                accepted += 1
            emitted = [(int(tokens[first + j]) + 1) % vocab for j in range(accepted + 1)]
            out[r, : len(emitted)] = emitted
            num[r] = len(emitted)
        return self.end_step(plan, StepResult(sampled_token_ids=out, num_sampled=num))
