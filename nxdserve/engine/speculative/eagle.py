"""EAGLE-1 proposer: a one-layer head over the target's own hidden states drafts k tokens greedily.

The head's cache position t holds the pair (token t+1, target feature f_t). The torch backend keeps
every scheduled token's final hidden state in ``StepResult.token_hidden_states`` (``keep_hidden_states``), and
``sync`` extends each slot's head cache over exactly the positions whose target state became final
this step - a prefill chunk's tokens, or a decode/verification row's input token plus its accepted
drafts - pairing each with the token that followed it. It runs for every row of every step, whether
or not that request drafts next, so the head's cache never has holes. Its output at the last of
those positions, ``h ~ f_{N-1}`` for a request with N tokens, gives draft 1 through the LM head;
then draft j is fed back as (draft j, h) at position N + j - 2 to give draft j + 1.

Those chained positions (N-1 .. N+k-3, below max_model_len since k <= max_model_len - 1 - N) carry
the head's own guesses; the next ``sync`` rewrites them from position N - 1 on with the target's
real states, because the target's next row starts exactly there.

Drafts stop early where the head is unsure: draft j is proposed only while the product of the
head's top probabilities for drafts 1..j stays at or above ``min_draft_confidence`` (EAGLE-2's
observation that a draft head's confidence tracks its acceptance rate). Every proposed token costs a
verification row in the target (and a chained head step), so a guess that is likely rejected makes
the step slower for nothing; a row whose first draft is unsure decodes plainly.

Alternatives (``draft_alternatives``, tree verification of width 1 + A at the first draft): the head's
next-best tokens for draft 1 ride along as extra tokens of the target's forward (``DraftAlternatives``).
When draft 1 is rejected and the target's own token is one of them, the row gains the target's token
after it, as if that alternative had been draft 1. On SmolLM2-135M chat the head's top-1 guess is right
40% of the time and its top-3 60%; at small batch the forward's few extra tokens cost little, since the
weights are read once for all of them. Only up to ``ALTERNATIVES_MAX_BATCH`` decoding requests, only for
requests whose extra token needs no per-position state (no logprobs, min_tokens already met), and only while
drafting steps with them yield more tokens per second than without (``alternatives_policy``, the batch-size
rule of policy.py over those two arms): where the target is bound by arithmetic at a few tokens (4-bit weights
on AVX2: two alternatives made a k = 3 step 1.5x longer, against 1.05-1.25x on AVX512-BF16) their hits may not
repay them.

A head trained with a truncated draft vocabulary (``draft_vocab_ids``) scores only those ids: the LM
head is the largest matmul of a draft step, so this makes drafting several times cheaper on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from nxdserve.engine.models import LlamaFamilyModel, cpu_kernels
from nxdserve.engine.models.attention import AttentionMetadata
from nxdserve.engine.models.linear import linear
from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.request import Request
from nxdserve.engine.speculative.base import DraftRows, SpeculativeProposer
from nxdserve.engine.speculative.config import SpeculativeConfig
from nxdserve.engine.speculative.eagle_head import EAGLE_CONFIG_KEY, EagleHead
from nxdserve.engine.speculative.policy import BatchSizePolicy
from nxdserve.engine.step import StepResult
from nxdserve.errors import ConfigError
from nxdserve.scheduler.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# Confidence bars that ``train-eagle`` writes into a head's ``eagle_config`` (see the module docstring).
# Draft 1 (``min_first_draft_confidence``) is nearly free to verify on the CPU backend: the fused forward
# runs a few more tokens of a row in about the time of one, and the head's output for it is computed anyway
# to keep the head's cache in step. Draft j >= 2 (``min_draft_confidence``, on the product of the top
# probabilities of drafts 1..j) costs a chained head call (~3% of a plain step on SmolLM2-135M) that is
# wasted when the chain's next draft is rejected. Both picked from held-out acceptance against measured
# step costs (docs/speculative.md). Heads with neither key always draft k.
DEFAULT_MIN_FIRST_DRAFT_CONFIDENCE = 0.05
DEFAULT_MIN_DRAFT_CONFIDENCE = 0.1
# Above this many decoding requests, steps that will not draft skip the head's cache update. Keeping the
# cache costs a head forward over every row's new tokens even when the batch-size rule has drafting off,
# which at batch 32 on SmolLM2-135M was ~10% of a plain step; requests whose cache misses a step never
# draft again (their drafts would read a hole), so this trades their later drafts for the large batch.
SYNC_WHILE_OFF_MAX_BATCH = 16
# Draft alternatives ride along only while at most this many requests decode: beyond it the extra tokens
# add GEMM work that a rare hit does not repay (see docs/speculative.md).
ALTERNATIVES_MAX_BATCH = 4
# An alternative below this head probability is not worth its token.
ALTERNATIVE_MIN_PROB = 0.02


class EagleProposer(SpeculativeProposer):
    method = "eagle"

    def __init__(
        self,
        spec: SpeculativeConfig,
        max_model_len: int,
        num_slots: int,
        head: EagleHead,
        target: LlamaFamilyModel,
    ) -> None:
        super().__init__(spec, max_model_len)
        if head.spec.hidden_size != target.spec.hidden_size:
            raise ConfigError(
                f"the EAGLE head has hidden_size {head.spec.hidden_size}, the target {target.spec.hidden_size}."
            )
        if head.max_len < max_model_len:
            raise ConfigError(f"the EAGLE head's RoPE table covers {head.max_len} positions < {max_model_len}.")
        self.head = head
        self.device = target.device
        self.embed_weight = target.embed_weight
        if head.draft_vocab_ids is not None:
            ids = head.draft_vocab_ids.to(self.device)
            self.vocab_ids: torch.Tensor | None = ids
            self.lm_weight = target.lm_head_weight.index_select(0, ids).contiguous()
        else:
            self.vocab_ids = None
            self.lm_weight = target.lm_head_weight
        # A head in another dtype than the target (``draft_dtype``) scores its own hidden states: the LM
        # head it uses is a copy in its dtype (embeddings are converted per lookup, a few rows at a time).
        if self.lm_weight.dtype != head.dtype:
            self.lm_weight = self.lm_weight.to(head.dtype)
        eagle_config = head.config.get(EAGLE_CONFIG_KEY) or {}
        self.min_confidence = float(eagle_config.get("min_draft_confidence", 0.0))
        # Draft 1 has its own (lower) bar: see ``DEFAULT_MIN_FIRST_DRAFT_CONFIDENCE``. Heads written before it
        # existed use min_draft_confidence for draft 1 too.
        self.min_first_confidence = float(eagle_config.get("min_first_draft_confidence", self.min_confidence))
        self.kv_cache = head.new_kv_cache(num_slots, max_model_len)
        self.kv_len = np.zeros(num_slots, dtype=np.int64)  # positions with (token, real feature) pairs
        # The head's output at its last real position, per slot: the predicted feature f_{N-1}.
        self.last_hidden = torch.zeros(num_slots, head.spec.hidden_size, dtype=head.dtype, device=self.device)
        self.last_pos = np.full(num_slots, -1, dtype=np.int64)
        self.owners: list[str | None] = [None] * num_slots
        self._warned_missing = False
        self.num_alternatives = spec.draft_alternatives  # 0 where the backend cannot verify them
        self._alternatives_now = False
        # Drafting steps with alternatives against those without, by batch bucket (measured, as drafting itself).
        self.alternatives_policy = BatchSizePolicy()
        self.stale = np.zeros(num_slots, dtype=bool)  # the slot's head cache missed a step: no more drafts
        # The head's attention always runs through the CPU slot-attention kernel when it can (it needs only
        # each token's slot and position), so its metadata is made directly instead of by
        # ``AttentionMetadata.build``, whose masks and row bookkeeping serve SDPA: ~0.1 ms per head call.
        spec_ = head.spec
        probe = torch.empty(1, spec_.num_heads, spec_.head_dim, dtype=head.dtype, device=self.device)
        self._direct_metadata = self.device.type == "cpu" and cpu_kernels.supports(probe, self.kv_cache.layer(0)[0])

    def set_policy_clock(self, clock: Callable[[], float]) -> None:
        super().set_policy_clock(clock)
        self.alternatives_policy.clock = clock

    def describe(self) -> dict[str, object]:
        """The base description plus the alternatives' measured rates ("on": drafting steps with them)."""
        return {**super().describe(), "alternatives_policy": self.alternatives_policy.describe()}

    # -- keeping the head's cache in step with the target --------------------------------------------
    def _propose(
        self, requests: list[Request], batch: PersistentBatch, sched: SchedulerOutput, result: StepResult
    ) -> None:
        self.alternatives_policy.observe(sched.plan, result)  # charges the last step, if it asked the policy
        decoding = [r for r in requests if r.slot is not None and r.num_computed_tokens == r.num_tokens - 1]
        drafting = self.policy.should_draft(len(decoding))
        self._alternatives_now = (
            drafting
            and self.num_alternatives > 0
            and len(decoding) <= ALTERNATIVES_MAX_BATCH
            and self.alternatives_policy.should_draft(len(decoding))
        )
        if drafting or len(decoding) <= SYNC_WHILE_OFF_MAX_BATCH:
            self.sync(batch, sched, result)
        else:  # see SYNC_WHILE_OFF_MAX_BATCH
            self._reset_reassigned(sched)
            if sched.plan.num_rows:
                self.stale[np.asarray(sched.plan.slots, dtype=np.int64)] = True
        if drafting:
            self.draft_into(decoding, batch)

    def _reset_reassigned(self, sched: SchedulerOutput) -> None:
        new = self.reassigned_slots(self.owners, sched)
        self.kv_len[new] = 0
        self.last_pos[new] = -1
        self.stale[new] = False

    @torch.inference_mode()
    def sync(self, batch: PersistentBatch, sched: SchedulerOutput, result: StepResult) -> None:
        plan = sched.plan
        self._reset_reassigned(sched)
        if plan.num_rows == 0:
            return
        hidden = result.token_hidden_states
        if hidden is None or result.token_offsets is None:
            if not self._warned_missing:
                logger.warning("EAGLE: the backend returned no hidden states; drafting is off")
                self._warned_missing = True
            return
        offsets = np.asarray(result.token_offsets, dtype=np.int64)
        lens = np.asarray(plan.num_scheduled, dtype=np.int64)
        drafts = np.asarray(plan.num_drafts, dtype=np.int64)
        sampled = np.asarray(result.num_sampled, dtype=np.int64)
        # Target states that became final: all of a prefill chunk, else the input token + accepted drafts.
        n_valid = np.where(np.asarray(plan.sample, dtype=bool), np.where(sampled > 0, lens - drafts + sampled - 1, 0),
                           lens)
        alive = np.fromiter((not r.status.is_finished for r in sched.requests), dtype=bool, count=plan.num_rows)
        rows = np.flatnonzero(alive & (n_valid > 0) & ~self.stale[np.asarray(plan.slots, dtype=np.int64)])
        if rows.size == 0:
            return
        slots = np.asarray(plan.slots, dtype=np.int64)[rows]
        starts = np.asarray(plan.start_pos, dtype=np.int64)[rows]
        n = n_valid[rows]
        if rows.size == 1:  # one row (single-stream decoding): slices instead of gathers
            slot, start, count, offset = int(slots[0]), int(starts[0]), int(n[0]), int(offsets[rows[0]])
            next_tokens = torch.from_numpy(batch.token_ids[slot, start + 1 : start + count + 1]).to(self.device)
            features = hidden[offset : offset + count]
            if features.dtype != self.head.dtype:
                features = features.to(self.head.dtype)
            out = self._run(next_tokens, features, slots, starts, n)
            self.last_hidden[slot] = out[-1]
        else:
            token_row = np.repeat(np.arange(rows.size), n)
            row_offsets = np.zeros(rows.size + 1, dtype=np.int64)
            np.cumsum(n, out=row_offsets[1:])
            within = np.arange(row_offsets[-1]) - row_offsets[token_row]
            positions = starts[token_row] + within
            next_tokens = torch.from_numpy(batch.token_ids[slots[token_row], positions + 1]).to(self.device)
            feature_index = torch.from_numpy(offsets[rows][token_row] + within).to(self.device)
            features = hidden.index_select(0, feature_index).to(self.head.dtype)
            out = self._run(next_tokens, features, slots, starts, n)
            last = torch.from_numpy(row_offsets[1:] - 1).to(self.device)
            self.last_hidden[torch.from_numpy(slots).to(self.device)] = out.index_select(0, last)
        self.last_pos[slots] = starts + n - 1
        self.kv_len[slots] = starts + n

    # -- drafting ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, rows: DraftRows, batch: PersistentBatch) -> tuple[np.ndarray, np.ndarray]:
        slots, n, k = rows.slots, rows.num_tokens, rows.k
        # The head is caught up to token N-1, with no step missing.
        lengths = np.where((self.last_pos[slots] == n - 2) & ~self.stale[slots], k, 0)
        k_max = int(k.max())
        drafts = np.full((slots.size, k_max), -1, dtype=np.int64)
        active = np.flatnonzero(lengths > 0)
        if active.size == 0:
            return drafts, lengths
        h = self.last_hidden.index_select(0, torch.from_numpy(slots[active]).to(self.device))
        current, conf, alternatives = self._first_drafts(h, rows, active)
        confidence = conf.cpu().numpy()
        drafts[active, 0] = current.cpu().numpy()
        if alternatives is not None:
            self.alternatives = np.full((slots.size, alternatives.shape[1]), -1, dtype=np.int64)
            self.alternatives[active] = alternatives
        # Draft 1 needs min_first_confidence; draft j >= 2 needs the product over drafts 1..j at
        # min_confidence, so a chain step runs only while that product still allows it.
        lengths[active] = np.where(confidence >= self.min_first_confidence, 1, 0)
        for j in range(1, k_max):
            keep = (k[active] > j) & (lengths[active] == j) & (confidence >= self.min_confidence)
            if not keep.all():
                index = torch.from_numpy(np.flatnonzero(keep)).to(self.device)
                active, current, h = active[keep], current.index_select(0, index), h.index_select(0, index)
                confidence = confidence[keep]
            if active.size == 0:
                break
            # (draft j, predicted feature) sits at position N + j - 2 and predicts draft j + 1.
            h = self._run(current, h, slots[active], n[active] + j - 2, np.ones(active.size, dtype=np.int64))
            current, conf = self._argmax(h)
            confidence = confidence * conf.cpu().numpy()
            drafts[active, j] = current.cpu().numpy()
            # Rows that became unsure keep the drafts before this one.
            lengths[active[confidence >= self.min_confidence]] = j + 1
        return drafts, lengths

    def _run(
        self, tokens: torch.Tensor, features: torch.Tensor, slots: np.ndarray, starts: np.ndarray, lens: np.ndarray
    ) -> torch.Tensor:
        meta = self._metadata(slots, starts, lens)
        embeds = F.embedding(tokens, self.embed_weight)
        if embeds.dtype != self.head.dtype:
            embeds = embeds.to(self.head.dtype)
        return self.head(embeds, features, meta, self.kv_cache)

    def _metadata(self, slots: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> AttentionMetadata:
        """Rows of ``lens[r]`` tokens of slot ``slots[r]`` from ``starts[r]``, as ``AttentionMetadata.build``
        makes them; made directly for the CPU kernel (each token attends its slot's keys up to its own
        position, which is all the head's rows need)."""
        max_end = int((starts + lens).max())
        max_slot = int(slots.max())
        if not self._direct_metadata or max_end > self.kv_cache.max_len or max_slot >= self.kv_cache.num_slots:
            return AttentionMetadata.build(
                slots, starts, lens,
                num_query_groups=self.head.num_query_groups,
                windows=self.head.windows,
                max_len=self.kv_cache.max_len,
                device=self.device,
            )  # fmt: skip
        if lens.size == 1:
            start, count = int(starts[0]), int(lens[0])
            positions = torch.arange(start, start + count, dtype=torch.int64)
            write_slots = torch.full((count,), max_slot, dtype=torch.int64)
        else:
            count = int(lens.sum())
            token_row = np.repeat(np.arange(lens.size), lens)
            first = np.cumsum(lens) - lens
            positions = torch.from_numpy(starts[token_row] + np.arange(count) - first[token_row])
            write_slots = torch.from_numpy(np.ascontiguousarray(slots[token_row], dtype=np.int64))
        return AttentionMetadata(
            num_tokens=count, positions=positions, write_slots=write_slots, batched=None, chunks=[],
            use_kernel=True, kernel_select=None, kernel_count=count, max_slot=max_slot, max_end=max_end,
        )  # fmt: skip

    def _first_drafts(
        self, hidden: torch.Tensor, rows: DraftRows, active: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None]:
        """Draft 1 as ``_argmax`` gives it, plus (len(active), A) alternatives, -1 padded (None: none)."""
        if not self._alternatives_now:
            return (*self._argmax(hidden), None)
        probs = self._probs(hidden)
        top_p, top = probs.topk(min(1 + self.num_alternatives, probs.shape[-1]), dim=-1)
        if self.vocab_ids is not None:
            top = self.vocab_ids[top]
        alternatives = np.where(top_p[:, 1:].cpu().numpy() >= ALTERNATIVE_MIN_PROB, top[:, 1:].cpu().numpy(), -1)
        # The row's extra token after an accepted alternative is sampled without per-position state.
        eligible = np.fromiter(
            (r.params.logprobs is None and r.num_output_tokens >= r.params.min_tokens
             for r in (rows.requests[i] for i in active)), dtype=bool, count=active.size,
        )  # fmt: skip
        alternatives[~eligible] = -1
        return top[:, 0], top_p[:, 0], alternatives

    def _probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's next-token distribution over its (draft) vocabulary, in float32."""
        return torch.softmax(linear(hidden, self.lm_weight).float(), dim=-1)

    def _argmax(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy draft ids (full vocabulary) and the head's probability for them."""
        conf, best = self._probs(hidden).max(dim=-1)
        return (best if self.vocab_ids is None else self.vocab_ids.index_select(0, best)), conf
