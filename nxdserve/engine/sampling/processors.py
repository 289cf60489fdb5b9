"""Logits processors that change the distribution before greedy/random selection (vLLM V1 order):
logit bias and min-tokens masking, then repetition/presence/frequency penalties.

All of them work in place on fp32 logits rows and run only for the rows that need them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.sampling.rows import RowParams, SlotTables, csr_take, to_device


@dataclass
class ProcessorPlan:
    """Which rows each processor touches; empty arrays mean the stage is skipped."""

    bias_rows: np.ndarray
    min_tokens_rows: np.ndarray
    penalty_rows: np.ndarray

    @classmethod
    def build(cls, rows: RowParams, tables: SlotTables) -> ProcessorPlan:
        below_min = (rows.num_output_tokens < rows.min_tokens) & tables.has_stop_ids(rows.slots)
        return cls(
            bias_rows=np.flatnonzero(tables.has_bias(rows.slots)),
            min_tokens_rows=np.flatnonzero(below_min),
            penalty_rows=np.flatnonzero(rows.needs_penalties),
        )

    @property
    def empty(self) -> bool:
        return not (self.bias_rows.size or self.min_tokens_rows.size or self.penalty_rows.size)


def apply_processors(
    logits: torch.Tensor,
    plan: ProcessorPlan,
    rows: RowParams,
    tables: SlotTables,
    batch: PersistentBatch,
    drafts: np.ndarray | None = None,
) -> None:
    """Apply bias, min-tokens and penalties to ``logits`` (R, V) fp32 in place.

    ``drafts`` (rows of the caller, D) is needed only when a penalised row sits after drafts
    (``rows.extra > 0``): those drafts are part of that position's history.
    """
    device = logits.device
    if plan.bias_rows.size:
        owner, flat = csr_take(tables.bias_offsets, rows.slots[plan.bias_rows])
        r = to_device(plan.bias_rows[owner], device)
        ids = to_device(tables.bias_ids[flat], device)
        logits.index_put_((r, ids), to_device(tables.bias_values[flat], device), accumulate=True)
    if plan.min_tokens_rows.size:
        owner, flat = csr_take(tables.stop_offsets, rows.slots[plan.min_tokens_rows])
        r = to_device(plan.min_tokens_rows[owner], device)
        logits[r, to_device(tables.stop_ids[flat], device)] = float("-inf")
    if plan.penalty_rows.size:
        p = plan.penalty_rows
        counts, prompt_seen = token_counts(
            batch,
            rows.slots[p],
            rows.num_tokens[p],
            rows.num_prompt_tokens[p],
            rows.extra[p],
            None if drafts is None else drafts[rows.src[p]],
            vocab_size=logits.shape[1],
            with_prompt=bool((rows.repetition_penalty[p] != 1.0).any()),
            device=device,
        )
        whole = p.size == rows.num_rows
        idx = to_device(p, device)
        sub = logits if whole else logits.index_select(0, idx)
        out = apply_penalties(
            sub,
            counts,
            prompt_seen,
            _param(rows.presence_penalty[p], 0.0, device),
            _param(rows.frequency_penalty[p], 0.0, device),
            _param(rows.repetition_penalty[p], 1.0, device),
        )
        if not whole:
            logits.index_copy_(0, idx, out)
        elif out is not logits:
            logits.copy_(out)


def _param(values: np.ndarray, neutral: float, device: torch.device) -> torch.Tensor | None:
    """The per-row values on device, or None when every row has the neutral value (stage skipped)."""
    return None if bool((values == neutral).all()) else to_device(values, device)


def token_counts(
    batch: PersistentBatch,
    slots: np.ndarray,
    num_tokens: np.ndarray,
    num_prompt_tokens: np.ndarray,
    extra: np.ndarray,
    drafts: np.ndarray | None,
    vocab_size: int,
    with_prompt: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Output-token counts (P, V) float32 and, if asked, prompt-token presence (P, V) bool.

    A row's history is ``batch.token_ids[slot, :num_tokens]`` followed by its first ``extra`` drafts.
    One scatter over a padded (P, L) index matrix; padding points at a dump column V.
    """
    total = num_tokens + extra
    width = int(total.max(initial=0))
    pos = np.arange(width, dtype=np.int64)[None, :]
    hist = np.full((slots.shape[0], width), vocab_size, dtype=np.int64)
    base_w = int(num_tokens.max(initial=0))
    base = batch.token_ids[slots, :base_w]
    hist[:, :base_w] = np.where(pos[:, :base_w] < num_tokens[:, None], base, vocab_size)
    if drafts is not None and extra.any():
        r, k = np.nonzero(np.arange(int(extra.max()))[None, :] < extra[:, None])
        hist[r, num_tokens[r] + k] = drafts[r, k]
    is_prompt = pos < num_prompt_tokens[:, None]
    out_idx = to_device(np.where(is_prompt, vocab_size, hist), device)
    counts = torch.zeros(slots.shape[0], vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, out_idx, torch.ones(out_idx.shape, dtype=torch.float32, device=device))
    prompt_seen = None
    if with_prompt:
        prompt_idx = to_device(np.where(is_prompt, hist, vocab_size), device)
        prompt_seen = torch.zeros(slots.shape[0], vocab_size + 1, dtype=torch.bool, device=device)
        prompt_seen.scatter_(1, prompt_idx, True)
        prompt_seen = prompt_seen[:, :vocab_size]
    return counts[:, :vocab_size], prompt_seen


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_seen: torch.Tensor | None,
    presence: torch.Tensor | None,
    frequency: torch.Tensor | None,
    repetition: torch.Tensor | None,
) -> torch.Tensor:
    """vLLM's penalties on (P, V) logits, in place where possible; returns the result.

    Repetition (CTRL-style) covers prompt and output tokens: positive logits are divided by the
    penalty, negative ones multiplied. Frequency and presence (OpenAI) cover output tokens only.
    A None penalty (no row uses it) is skipped; decided on the host so there is no device sync.
    """
    seen_out = output_counts > 0
    if repetition is not None:
        seen = seen_out if prompt_seen is None else seen_out | prompt_seen
        rep = torch.where(seen, repetition[:, None], torch.ones((), device=logits.device))
        logits = torch.where(logits > 0, logits / rep, logits * rep)
    if frequency is not None:
        logits = logits.sub_(frequency[:, None] * output_counts)
    if presence is not None:
        logits = logits.sub_(presence[:, None] * seen_out)
    return logits
