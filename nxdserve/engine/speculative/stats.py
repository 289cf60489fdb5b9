"""Acceptance counters for the periodic log line (Prometheus counters are fed by EngineCore).

Same definitions as vLLM's SpecDecodingLogging: mean acceptance length = 1 + accepted / drafts
(the +1 is the target's own token), per-position rate = accepted at position i / drafts, and draft
acceptance rate = accepted / drafted tokens.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from nxdserve.engine.step import StepPlan, StepResult

logger = logging.getLogger("nxdserve.engine.speculative")

LOG_INTERVAL_S = 10.0


class SpecStats:
    def __init__(self, max_spec_tokens: int, log_interval_s: float = LOG_INTERVAL_S) -> None:
        self.k = max_spec_tokens
        self.log_interval_s = log_interval_s
        self.total = _Window(max_spec_tokens)  # since start
        self.window = _Window(max_spec_tokens)  # since the last log line
        self._window_start = time.monotonic()

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        alternatives = result.draft_alternatives
        if alternatives is not None:
            for w in (self.total, self.window):
                w.num_alternatives += alternatives[0]
                w.num_alternative_hits += alternatives[1]
        drafts = np.asarray(plan.num_drafts, dtype=np.int64)
        sampled = np.asarray(result.num_sampled, dtype=np.int64)
        rows = (drafts > 0) & (sampled > 0)
        if not rows.any():
            return
        d = drafts[rows]
        accepted = np.minimum(sampled[rows] - 1, d)
        positions = np.arange(self.k)[None, :]
        per_pos = (positions < accepted[:, None]).sum(axis=0)
        for w in (self.total, self.window):
            w.add(int(rows.sum()), int(d.sum()), per_pos, int(d.max()))

    @property
    def mean_acceptance_length(self) -> float:
        return self.total.mean_acceptance_length

    def log_line(self, reset: bool = True) -> str | None:
        """vLLM's "SpecDecoding metrics" line over the window since the last call; None if idle."""
        w, now = self.window, time.monotonic()
        if w.num_drafts == 0:
            return None
        elapsed = max(now - self._window_start, 1e-9)
        per_pos = ", ".join(f"{r:.3f}" for r in w.accepted_per_pos[: w.width] / w.num_drafts)
        line = (
            f"SpecDecoding metrics: Mean acceptance length: {w.mean_acceptance_length:.2f}, "
            f"Accepted throughput: {w.num_accepted / elapsed:.2f} tokens/s, "
            f"Drafted throughput: {w.num_draft_tokens / elapsed:.2f} tokens/s, "
            f"Accepted: {w.num_accepted} tokens, Drafted: {w.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {per_pos}, "
            f"Avg Draft acceptance rate: {100.0 * w.num_accepted / max(w.num_draft_tokens, 1):.1f}%"
        )
        if w.num_alternatives:  # nxdserve's draft alternatives (their hits are counted as accepted above)
            line += f", Alternatives: {w.num_alternative_hits} of {w.num_alternatives} accepted"
        if reset:
            self.window = _Window(self.k)
            self._window_start = now
        return line

    def maybe_log(self) -> None:
        if time.monotonic() - self._window_start >= self.log_interval_s:
            line = self.log_line()
            if line is not None:
                logger.info(line)


class _Window:
    def __init__(self, k: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.accepted_per_pos = np.zeros(k, dtype=np.int64)
        self.width = 0  # longest draft seen, for the per-position list
        self.num_alternatives = 0  # draft alternatives verified (EAGLE's next-best first drafts)
        self.num_alternative_hits = 0  # ... and accepted: their rows' first drafts were rejected

    def add(self, num_drafts: int, num_draft_tokens: int, per_pos: np.ndarray, width: int) -> None:
        self.num_drafts += num_drafts
        self.num_draft_tokens += num_draft_tokens
        self.accepted_per_pos += per_pos
        self.width = max(self.width, width)

    @property
    def num_accepted(self) -> int:
        return int(self.accepted_per_pos.sum())

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else 0.0
