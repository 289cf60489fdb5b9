"""The backend contract: what the engine core asks of a model executor, and what it gets back.

Flow per step: ``Scheduler.schedule() -> StepPlan -> Backend.execute(plan) -> StepResult``. A plan
names slots, not requests: the tokens to run are read from the shared ``PersistentBatch``
(``token_ids[slot, start_pos : start_pos + num_scheduled]``; the last ``num_drafts`` of them are
speculative drafts). Sampling happens inside the backend, per row, with the slot's own parameters
and generator.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.structured.mask import StepTokenMask
from nxdserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class BackendCapabilities:
    max_num_seqs: int
    max_model_len: int
    max_prompt_len: int  # longest prompt one request may carry
    vocab_size: int
    # One forward may run decode rows and prefill rows together (else steps are all-prefill or
    # all-decode).
    mixed_prefill_decode: bool = True
    # A prompt may be split into chunks that start at any position of its slot.
    chunked_prefill: bool = True
    # Token generation must include every live slot (NxD's contiguous KV: pad rows write other lines).
    decode_all_live_slots: bool = False
    # At most this many prompts per prefill forward (NxD context encoding runs one prompt per call).
    max_prefills_per_step: int | None = None
    # Speculation methods the backend runs itself (fused on device); others come from engine proposers.
    fused_spec_methods: frozenset[str] = frozenset()
    # Drafts it can verify in the same forward as plain decode rows.
    supports_draft_verification: bool = True
    # Verifies alternatives to a row's first draft in the same forward (StepPlan.draft_alternatives).
    draft_alternatives: bool = False
    global_top_k: int | None = None  # sampling happens within the top global_top_k logits (NxD)
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class StepPlan:
    """Rows sorted by slot. ``start_pos`` is the slot's computed-token count before this step."""

    slots: np.ndarray  # (R,) int64
    start_pos: np.ndarray  # (R,) int64
    num_scheduled: np.ndarray  # (R,) int64 tokens to run, drafts included
    num_drafts: np.ndarray  # (R,) int64
    # Row reaches the end of its known tokens, so the backend samples (a decode, a verification, the
    # last chunk of a prompt). False for a non-final prefill chunk: no token comes back.
    sample: np.ndarray  # (R,) bool
    # Per-row draft-token probabilities (R, max_drafts, V) when a stochastic proposer made the drafts;
    # None means drafts are point proposals (p_draft = 1), as for n-gram or greedy drafting.
    draft_probs: Any = None
    # (R, A) int64, -1 padded: alternatives to each drafting row's first draft (point proposals too). One of
    # them is accepted when the first draft is rejected and the target's own token is that alternative; the
    # row then also emits the target's token after it. None: no row has any.
    draft_alternatives: np.ndarray | None = None
    # Slots freed or taken since the previous plan, for backends that keep per-slot device state.
    freed_slots: list[int] = field(default_factory=list)
    new_slots: list[int] = field(default_factory=list)
    # Structured outputs: allowed tokens of the constrained rows at each sampled position (set by
    # EngineCore.execute); the sampler applies it. None: no row is constrained.
    token_mask: StepTokenMask | None = None

    @property
    def num_rows(self) -> int:
        return int(self.slots.shape[0])

    @property
    def total_tokens(self) -> int:
        return int(self.num_scheduled.sum())

    @property
    def is_decode_only(self) -> bool:
        return bool(np.all(self.num_scheduled - self.num_drafts == 1) and np.all(self.sample))


@dataclass
class LogprobsBlock:
    """Logprobs of chosen tokens with the top-n alternatives. Entry [..., 0] is the chosen token."""

    token_ids: np.ndarray  # (..., 1 + n) int64
    logprobs: np.ndarray  # (..., 1 + n) float32
    ranks: np.ndarray  # (...,) int64 rank of the chosen token (1 = most likely)


@dataclass
class StepResult:
    # (R, W) tokens that come out of each row, -1 padded; W = 1 + max drafts in the plan.
    sampled_token_ids: np.ndarray
    num_sampled: np.ndarray  # (R,) 0 for a non-final prefill chunk, 1 + accepted drafts otherwise
    logprobs: LogprobsBlock | None = None  # shapes (R, W, 1 + n)
    # row index -> logprobs of prompt tokens predicted inside this chunk, shapes (m, 1 + n)
    prompt_logprobs: dict[int, LogprobsBlock] | None = None
    timings: dict[str, float] = field(default_factory=dict)  # seconds: prepare, forward, sample
    aux: dict[str, Any] = field(default_factory=dict)  # backend extras for proposers


class Backend(abc.ABC):
    """A model executor. ``execute`` runs in the engine's worker thread, never on the event loop."""

    name: str = "base"
    # Called by ``execute`` (in the worker thread) when its own Python is done and the model's compute, which
    # releases the GIL, begins; None: nobody listens. The async engine holds back its Python until then (where
    # the backend says it reports it), so that the two threads do not take turns on the GIL while the step is
    # being set up.
    forward_started: Callable[[], None] | None = None
    reports_forward_start: bool = False

    @property
    @abc.abstractmethod
    def capabilities(self) -> BackendCapabilities: ...

    @abc.abstractmethod
    def bind(self, batch: PersistentBatch) -> None:
        """Called once, before the first step, with the engine's persistent batch."""

    @abc.abstractmethod
    def execute(self, plan: StepPlan) -> StepResult: ...

    def validate_request(self, params: SamplingParams) -> None:  # noqa: B027 - optional hook
        """Raise InvalidRequestError for parameters this backend cannot honour (checked at admission)."""

    def own_thread(self) -> None:  # noqa: B027 - optional hook
        """Called in the worker thread when the engine owns it (the async engine's model thread, which runs
        nothing else): the backend may bind it and its helpers to CPUs."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release device resources."""
