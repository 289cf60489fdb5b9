"""What every proposer shares: who gets drafts this step, how many, and the bookkeeping around it.

After each step EngineCore calls ``propose(scheduler.running, batch, sched, result)``. A request
gets drafts when it is in the decode phase (its prompt is fully computed and the token to feed next
is known), has no drafts pending already, and samples without presence/frequency/repetition
penalties (vLLM excludes those too: a penalty changes the target distribution after every accepted
token, so the drafts' verification would need per-position penalty state). Its lookahead is

    k_r = min(k, max_model_len - 1 - num_tokens, max_tokens - num_output_tokens - 1)

so that verification never runs a position at or past ``max_model_len - 1`` (the scheduler clamps
the same way, and also by the step's token budget) and never drafts past the request's own output
limit. Rows with k_r <= 0 simply decode. Subclasses implement ``draft`` and, when they keep
per-slot state (a draft KV cache), ``sync``.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.request import Request
from nxdserve.engine.speculative.config import SpeculativeConfig
from nxdserve.engine.speculative.policy import BatchSizePolicy
from nxdserve.engine.speculative.stats import SpecStats
from nxdserve.engine.step import StepResult
from nxdserve.scheduler.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class DraftRows:
    """The requests that get drafts this step, with their slots, lengths and lookaheads."""

    requests: list[Request]
    slots: np.ndarray  # (R,) int64
    num_tokens: np.ndarray  # (R,) int64 prompt + output tokens (the next position to fill)
    k: np.ndarray  # (R,) int64 lookahead, >= 1

    @property
    def num_rows(self) -> int:
        return len(self.requests)


class SpeculativeProposer(abc.ABC):
    """Implements EngineCore's ``Proposer`` protocol."""

    method: str = "base"

    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.max_spec_tokens = self.k
        self.max_model_len = max_model_len
        self.stats = SpecStats(self.k)
        self.policy = BatchSizePolicy(spec.disable_by_batch_size)
        self.failures = 0  # proposer exceptions caught (each costs one step its drafts)
        # Set by ``draft`` when it proposes alternatives to first drafts: (R, A) int64, -1 padded.
        self.alternatives: np.ndarray | None = None

    def set_policy_clock(self, clock: Callable[[], float]) -> None:
        """The clock the measured policies time steps with (wall time where the model runs on an accelerator)."""
        self.policy.clock = clock

    # -- the Proposer protocol ---------------------------------------------------------------------
    def propose(
        self, requests: list[Request], batch: PersistentBatch, sched: SchedulerOutput, result: StepResult
    ) -> None:
        self.stats.observe(sched.plan, result)
        self.policy.observe(sched.plan, result)
        try:
            self._propose(requests, batch, sched, result)
        except Exception:  # drafts are an optimisation: a proposer bug must not take requests down
            self.failures += 1
            if self.failures == 1:
                logger.exception("speculation: the %s proposer failed; this step decodes without drafts",
                                 self.method)
            for request in requests:
                request.spec_token_ids = []
                request.spec_alt_ids = []
        self.stats.maybe_log()

    def _propose(
        self, requests: list[Request], batch: PersistentBatch, sched: SchedulerOutput, result: StepResult
    ) -> None:
        self.sync(batch, sched, result)
        decoding = [r for r in requests if r.slot is not None and r.num_computed_tokens == r.num_tokens - 1]
        if not self.policy.should_draft(len(decoding)):
            return
        self.draft_into(decoding, batch)

    def draft_into(self, decoding: list[Request], batch: PersistentBatch) -> None:
        """Draft for the decoding requests this proposer selects and set their ``spec_token_ids``."""
        rows = self.select(decoding)
        if rows is None:
            return
        self.alternatives = None
        drafts, lengths = self.draft(rows, batch)
        alternatives = self.alternatives
        for i, request in enumerate(rows.requests):
            n = int(lengths[i])
            request.spec_token_ids = drafts[i, :n].tolist() if n > 0 else []
            if alternatives is not None and n > 0:
                request.spec_alt_ids = [t for t in alternatives[i].tolist() if t >= 0]

    # -- shared rules ------------------------------------------------------------------------------
    def select(self, decoding: list[Request]) -> DraftRows | None:
        """Decode-phase requests that take drafts, with their lookahead (None if there are none)."""
        chosen: list[Request] = []
        ks: list[int] = []
        for r in decoding:
            if r.spec_token_ids or r.params.needs_penalties:
                continue
            k = min(self.k, self.max_model_len - 1 - r.num_tokens, r.max_tokens - r.num_output_tokens - 1)
            if k > 0:
                chosen.append(r)
                ks.append(k)
        if not chosen:
            return None
        return DraftRows(
            requests=chosen,
            slots=np.fromiter((r.slot for r in chosen), dtype=np.int64, count=len(chosen)),
            num_tokens=np.fromiter((r.num_tokens for r in chosen), dtype=np.int64, count=len(chosen)),
            k=np.asarray(ks, dtype=np.int64),
        )

    # -- per method --------------------------------------------------------------------------------
    def sync(self, batch: PersistentBatch, sched: SchedulerOutput, result: StepResult) -> None:  # noqa: B027
        """Bring per-slot proposer state in line with the step that just ran (default: none)."""

    @abc.abstractmethod
    def draft(self, rows: DraftRows, batch: PersistentBatch) -> tuple[np.ndarray, np.ndarray]:
        """Greedy drafts: ``(tokens (R, >= max k) int64, lengths (R,) int64)``, lengths[r] <= rows.k[r]."""

    @staticmethod
    def reassigned_slots(owners: list[str | None], sched: SchedulerOutput) -> np.ndarray:
        """Slots in this step's plan that now hold another request than the proposer last saw there
        (new admissions, including ones whose first step failed and never reached the proposer);
        records the new owners. Per-slot proposer state of these slots must start over."""
        fresh = {int(slot) for slot in sched.plan.new_slots}  # also catches a reused request id
        for row, request in enumerate(sched.requests):
            slot = int(sched.plan.slots[row])
            if owners[slot] != request.request_id:
                owners[slot] = request.request_id
                fresh.add(slot)
        return np.fromiter(sorted(fresh), dtype=np.int64, count=len(fresh))

    def describe(self) -> dict[str, object]:
        return {
            "method": self.method,
            "num_speculative_tokens": self.k,
            "mean_acceptance_length": round(self.stats.mean_acceptance_length, 3),
            "policy": self.policy.describe(),
        }
