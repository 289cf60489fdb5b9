"""When drafting pays: speculation on or off by batch size, decided from measured step costs.

Speculation trades compute for latency. A decode step of B requests with k drafts each runs
B(k+1) tokens through the target plus the drafting itself, and yields B(1 + accepted) tokens. While
the target is bound by weight reads and per-step overhead (small B) the extra tokens are nearly
free; once B is large enough that compute dominates, every rejected draft is wasted work and the
step gets slower than plain decode.

The rule (used when ``disable_by_batch_size`` is not set): batch sizes are bucketed by powers of two
(1, 2, 3-4, 5-8, ..., 33-64, ...). For each bucket the policy keeps the generated tokens per second
of the last ``WINDOW`` decode-only steps with drafting on and with it off, and drafts when the
"on" rate is at least the "off" rate (above ``LARGE_BATCH`` requests, at least ``LARGE_BATCH_MARGIN``
above it). A step's cost is everything between two
``observe`` calls (drafting, scheduling, the forward, sampling, output processing), measured on the
engine's own CPU clock (``time.process_time``) when the model runs on CPU: on a shared machine
other processes stretch wall time at random but not the work a step costs, and where the engine has
the CPU to itself the two are proportional. (On an accelerator the wall clock is used.) An arm's
rate is its window's tokens over its window's seconds, leaving out steps slower than
``OUTLIER_FACTOR`` x the window's median step (one outlier step must not flip the decision). Not the
median of per-step rates: a drafting step yields 1 token when its first draft is rejected and 2..k+1
when not, so with first-draft acceptance below one half the median step is a rejected one, and a
median would turn drafting off even where its mean rate is well ahead. Each bucket starts by
trying both arms a few times; afterwards the losing arm is still re-measured now and then so the
decision follows changes in acceptance (a grounded workload turning into free chat) and in load: every
``EXPLORE_EVERY`` steps while the arms are close, less often the further behind the loser is, so that
re-measuring costs about ``EXPLORE_COST`` of the time (a step of n-gram drafting on free chat at batch 32
took 1.6x a plain one; re-measuring it every 16 steps cost 4% there). Steps that run prefill are not
decode-only and never count.

With ``disable_by_batch_size`` set, the rule is vLLM V0's: draft only while at most that many
requests are decoding.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from nxdserve.engine.step import StepPlan, StepResult

WARMUP_STEPS = 3  # per arm and bucket before the measured rule takes over
EXPLORE_EVERY = 16  # then re-measure the losing arm at most on 1 step in this many ...
EXPLORE_COST = 0.01  # ... and, when it is far behind, rarely enough that this is what re-measuring costs ...
EXPLORE_MAX = 256  # ... but at least on 1 step in this many
WINDOW = 16  # recent steps per arm whose pooled rate decides
OUTLIER_FACTOR = 4.0  # steps this many times slower than the window's median are left out
# Above this many decoding requests drafting must beat plain decoding by LARGE_BATCH_MARGIN to stay on. There
# the steps are compute-bound, so a wrong "on" costs the most, and a tie gains nothing; and on a shared
# machine two arms' rates differ by a few percent at random (n-gram on grounded text at 17-32 requests
# measured 428 vs 429 tok/s on vs off, while the benchmark's ratio ranged 0.83-1.04x between runs).
LARGE_BATCH = 16
LARGE_BATCH_MARGIN = 0.05


def explore_interval(winner_rate: float, loser_rate: float) -> int:
    """Steps between re-measurements of the losing arm: each costs the winner/loser rate ratio - 1 of a step."""
    if loser_rate <= 0.0:
        return EXPLORE_MAX
    excess = max(winner_rate / loser_rate - 1.0, 0.0)
    return min(EXPLORE_MAX, max(EXPLORE_EVERY, math.ceil(round(excess / EXPLORE_COST, 6))))


def batch_bucket(num_decoding: int) -> int:
    """0 for 1 request, 1 for 2, 2 for 3-4, 3 for 5-8, ...: ceil(log2(B))."""
    return max(0, int(num_decoding - 1).bit_length())


@dataclass
class _Arm:
    recent: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))  # (tokens, s)
    steps: int = 0

    def add(self, tokens: float, seconds: float) -> None:
        self.recent.append((tokens, seconds))
        self.steps += 1

    @property
    def rate(self) -> float:
        """Tokens per second over the window, without outlier steps (see the module docstring)."""
        if not self.recent:
            return 0.0
        limit = OUTLIER_FACTOR * statistics.median(s for _, s in self.recent)
        kept = [(t, s) for t, s in self.recent if s <= limit]
        return sum(t for t, _ in kept) / sum(s for _, s in kept)


class BatchSizePolicy:
    def __init__(
        self, disable_by_batch_size: int | None = None, clock: Callable[[], float] = time.process_time
    ) -> None:
        self.disable_by_batch_size = disable_by_batch_size
        self.clock = clock
        self._last_observed: float | None = None
        self._arms: dict[tuple[int, bool], _Arm] = {}
        self._since_explore: dict[int, int] = {}
        self._pending: tuple[int, bool] | None = None  # decision whose step has not been measured yet

    def should_draft(self, num_decoding: int) -> bool:
        """Decide for the next step; ``num_decoding`` counts every request in the decode phase."""
        if num_decoding <= 0:
            self._pending = None
            return False
        if self.disable_by_batch_size is not None:
            self._pending = None
            return num_decoding <= self.disable_by_batch_size
        bucket = batch_bucket(num_decoding)
        on, off = self._arm(bucket, True), self._arm(bucket, False)
        if on.steps < WARMUP_STEPS or off.steps < WARMUP_STEPS:
            draft = on.steps <= off.steps  # alternate, starting with "on"
        else:
            margin = LARGE_BATCH_MARGIN if num_decoding > LARGE_BATCH else 0.0
            draft = on.rate >= off.rate * (1.0 + margin)
            since = self._since_explore.get(bucket, 0) + 1
            winner, loser = (on, off) if draft else (off, on)
            if since >= explore_interval(winner.rate, loser.rate):
                draft, since = not draft, 0
            self._since_explore[bucket] = since
        self._pending = (bucket, draft)
        return draft

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        """Charge the step that just ran to the decision that shaped it (decode-only steps only).
        Call once per step, before drafting for the next one."""
        now = self.clock()
        last, self._last_observed = self._last_observed, now
        pending, self._pending = self._pending, None
        if pending is None or last is None or plan.num_rows == 0 or not plan.is_decode_only:
            return
        bucket, draft = pending
        if batch_bucket(plan.num_rows) != bucket:
            return  # the batch changed under the decision; its cost says nothing about this bucket
        seconds = now - last
        if seconds <= 0.0:
            return
        tokens = float(np.asarray(result.num_sampled).sum())
        self._arm(bucket, draft).add(tokens, seconds)

    def _arm(self, bucket: int, draft: bool) -> _Arm:
        return self._arms.setdefault((bucket, draft), _Arm())

    def describe(self) -> dict[str, dict[str, float]]:
        """Measured rates per bucket (for logs and the benchmark)."""
        out: dict[str, dict[str, float]] = {}
        for (bucket, draft), arm in sorted(self._arms.items()):
            if arm.steps == 0:
                continue
            lo, hi = (1, 1) if bucket == 0 else (2 ** (bucket - 1) + 1, 2**bucket)
            out.setdefault(f"{lo}-{hi}", {})["on" if draft else "off"] = round(arm.rate, 2)
        return out
