"""The step contract, owned by no layer: what the scheduler plans, what a backend returns.

Flow per step: ``Scheduler.schedule() -> StepPlan -> Backend.execute(plan) -> StepResult ->
Scheduler.update_from_output -> [RequestUpdate]``. A plan names slots, not requests. The backend owns
the persistent batch (the per-slot token and sampling-parameter arrays) and brings it up to date from
the plan's diffs at the start of ``execute``, in its own thread, as vLLM V1's model runner does with its
scheduler output:

- ``freed_slots``: slots whose request finished, was aborted or was preempted since the previous plan
  (applied first: a slot may be freed and taken again between two plans); ``preempted_slots`` says which of
  them a preemption freed, so that the request's sampling generator waits for its resumption;
- ``new_requests``: requests admitted in this plan, with their slot, prompt and sampling parameters; a
  resumed request (preempted earlier) also carries the tokens it had generated, to recompute;
- ``discarded_request_ids``: preempted requests that finished while waiting (their kept state goes);
- ``draft_token_ids``: each row's drafts, to run after its last real token.

Tokens a step samples are appended by the backend itself at the end of ``execute`` (``num_sampled[r]``
tokens of row r): the scheduler keeps the same tokens, and the only case where it keeps fewer (a stop
token among accepted drafts, or max_tokens reached) finishes the request, whose slot then comes back as a
freed slot in the next plan. So no correction ever needs to travel, and token history is in the batch
as soon as the step ends, for the proposers that draft from it in the same worker thread.

The tokens a row runs are ``token_ids[slot, start_pos : start_pos + num_scheduled]`` of the batch; the
last ``num_drafts`` of them are drafts. Sampling happens inside the backend, per row, with the slot's
own parameters and generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from nxdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from nxdserve.engine.mm_inputs import MultiModalInputs
    from nxdserve.engine.request import Request
    from nxdserve.engine.structured.mask import StepTokenMask
    from nxdserve.lora.adapter import LoraAdapter


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
    # The model is a vision-language model the backend drives end to end: prompts may carry images.
    image_inputs: bool = False
    # A preempted request may come back as a new request whose prompt is followed by its generated tokens
    # (NewRequest.output_token_ids), recomputed like a prompt (priority scheduling's preemption).
    resume_by_recompute: bool = True


@dataclass(frozen=True)
class NewRequest:
    """A request admitted in this plan: what the backend writes into its slot of the batch."""

    slot: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Ids masked until min_tokens outputs exist (eos + stop_token_ids); empty without min_tokens.
    min_tokens_stop_ids: list[int]
    # The LoRA adapter the request runs with (nxdserve.lora.adapter.LoraAdapter, host weights); None: base.
    lora: LoraAdapter | None = None
    # A resumed request (preempted before): the tokens it had generated, written after the prompt and
    # recomputed with it; its prompt logprobs were sent already and its seeded generator continues.
    output_token_ids: list[int] = field(default_factory=list)
    resumed: bool = False
    # The prompt's images (vision-language models, ``BackendCapabilities.image_inputs``); None: text only.
    mm_inputs: MultiModalInputs | None = None


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
    # -- diffs to the backend's persistent batch, applied in this order ----------------------------
    freed_slots: list[int] = field(default_factory=list)
    preempted_slots: list[int] = field(default_factory=list)  # among freed_slots: their requests will resume
    discarded_request_ids: list[str] = field(default_factory=list)  # preempted, then finished while waiting
    new_requests: list[NewRequest] = field(default_factory=list)
    # (R, max drafts) int64, -1 padded: row r's drafts in its first num_drafts[r] columns. None: no drafts.
    draft_token_ids: np.ndarray | None = None
    # Structured outputs: the constrained rows' allowed tokens at each sampled position, attached by
    # EngineCore.execute (nxdserve.engine.structured); the sampler applies it. None: no row is constrained.
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

    @property
    def new_slots(self) -> list[int]:
        """Slots taken in this plan, for backends and proposers that keep per-slot state."""
        return [new.slot for new in self.new_requests]


@dataclass
class LogprobsBlock:
    """Logprobs of chosen tokens with the top-n alternatives. Entry [..., 0] is the chosen token."""

    token_ids: np.ndarray  # (..., 1 + n) int64
    logprobs: np.ndarray  # (..., 1 + n) float32
    ranks: np.ndarray  # (...,) int64 rank of the chosen token (1 = most likely)


@dataclass(frozen=True)
class FusedSpecResult:
    """Speculation a backend verified on its device (NxD fused speculation): the plan had no drafts."""

    accepted_drafts: np.ndarray  # (R,) int64 drafts accepted per row; -1 for rows that verified nothing
    num_drafts: int  # drafts each verifying row proposed


@dataclass
class StepResult:
    # (R, W) tokens that come out of each row, -1 padded; W = 1 + max drafts in the plan.
    sampled_token_ids: np.ndarray
    num_sampled: np.ndarray  # (R,) 0 for a non-final prefill chunk, 1 + accepted drafts otherwise
    logprobs: LogprobsBlock | None = None  # shapes (R, W, 1 + n)
    # row index -> logprobs of prompt tokens predicted inside this chunk, shapes (m, 1 + n)
    prompt_logprobs: dict[int, LogprobsBlock] | None = None
    timings: dict[str, float] = field(default_factory=dict)  # seconds: prepare, forward, sample
    # (alternatives run, alternatives that won), when the plan carried draft alternatives.
    draft_alternatives: tuple[int, int] | None = None
    fused_spec: FusedSpecResult | None = None
    # Only while a proposer asks for them (the backend's ``keep_hidden_states``), for EAGLE:
    hidden_states: torch.Tensor | None = None  # (R, W, H) final states of each row's sampled positions
    # Every scheduled token's state, rows concatenated: row r's at token_offsets[r]:token_offsets[r + 1].
    token_hidden_states: torch.Tensor | None = None
    token_offsets: np.ndarray | None = None  # (R + 1,) int64


@dataclass
class RequestUpdate:
    """What one step did for one request, before detokenization."""

    request: Request
    row: int  # row in the step's plan/result
    new_token_ids: list[int]
    finished: bool
    num_drafts: int = 0
    num_accepted_drafts: int = 0
    prompt_logprobs_rows: list[int] = field(default_factory=list)
