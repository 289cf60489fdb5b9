"""min-p, top-k and top-p as one per-row logit threshold.

Each row keeps the tokens whose (temperature-scaled) logit is >= its threshold, so every
truncation becomes one comparison against a (R,) vector. Semantics follow vLLM V1: min-p first
(relative to the most likely token), then top-k, then top-p over the renormalised survivors,
always keeping the most likely token. Ties at a cut are all kept (thresholds are by value), which
makes the result independent of how a sort orders equal logits.

Finding the top-k/top-p cut needs the row in descending order. A full sort of a 50k vocabulary is
slow on CPU (about 3.4 ms per row on one core), while the mass of a real LLM distribution usually
sits in a few dozen tokens, so rows are tried against a ladder of ``topk`` candidate sets first
(a top-64 costs about 0.09 ms per row). A row whose cut is not provably inside its candidates
moves up the ladder, and the last rung is a full sort of only those rows. A ladder of ``()`` is
plain one-sort behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from nxdserve.engine.sampling.rows import to_device

NEG_INF = float("-inf")


@dataclass
class Support:
    """Where each row's sampling support lies after truncation."""

    # (R,) keep logits >= threshold (-inf: keep all); None when no row truncates.
    threshold: torch.Tensor | None = None
    # Rows whose whole support lies inside their first-rung candidates (sorted descending), so they
    # can be sampled over K candidates instead of V tokens. Logits are -inf outside the support.
    cand_rows: np.ndarray | None = None  # (C,) row indices
    cand_ids: torch.Tensor | None = None  # (C, K) int64
    cand_logits: torch.Tensor | None = None  # (C, K) fp32


def restrict_support(
    logits: torch.Tensor,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    ladder: tuple[int, ...] = (),
) -> Support:
    """Per-row thresholds for (R, V) temperature-scaled logits; ``logits`` is not modified."""
    num_rows, vocab = logits.shape
    device = logits.device
    use_min_p = min_p > 0.0
    use_top_k = (top_k > 0) & (top_k < vocab)
    use_top_p = top_p < 1.0
    if not (use_min_p.any() or use_top_k.any() or use_top_p.any()):
        return Support()

    if use_min_p.any():
        # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p): no softmax needed.
        log_min_p = np.full(num_rows, NEG_INF, dtype=np.float32)
        log_min_p[use_min_p] = np.log(min_p[use_min_p])
        threshold = logits.amax(dim=-1) + to_device(log_min_p, device)
    else:
        threshold = torch.full((num_rows,), NEG_INF, device=device)

    pending = np.flatnonzero(use_top_k | use_top_p)
    support = Support(threshold=threshold)
    # Enough candidates that the k-th largest is never the last one (its ties might continue past it).
    k_max = int(top_k[pending][use_top_k[pending]].max(initial=0))
    # What a row's last rung learnt: the share of the survivors' mass inside its candidates and the
    # share of its last candidate. No further candidate can hold more than the last one, so a row that
    # could not reach top_p even then skips the rung (a flat distribution goes straight to the sort).
    mass = np.full(num_rows, np.inf)
    last = np.zeros(num_rows)
    tried = np.zeros(num_rows, dtype=np.int64)
    for rung, size in enumerate((*ladder, vocab)):
        if pending.size == 0:
            break
        width = max(size, k_max + 1)
        width = vocab if 2 * width > vocab else width  # a top-k that wide costs as much as a sort
        attempt = pending
        if width < vocab:
            attempt = pending[mass[pending] + (width - tried[pending]) * last[pending] >= top_p[pending]]
            if attempt.size == 0:
                continue
        idx = to_device(attempt, device)
        sub = logits if attempt.size == num_rows else logits.index_select(0, idx)
        if width == vocab:
            vals, ids = sub.sort(dim=-1, descending=True)
        else:
            vals, ids = sub.topk(width, dim=-1)
        base = threshold[idx]  # min-p only: rows not resolved here retry from it on the next rung
        cut = _cut(vals, ids, sub, base, top_k[attempt], top_p[attempt], use_min_p[attempt], width == vocab)
        threshold[idx] = torch.where(cut.resolved, cut.threshold, base)
        # One small device->host copy per rung: the host decides which rows go on.
        info = torch.stack([cut.resolved.to(cut.mass.dtype), cut.mass, cut.last]).cpu().numpy()
        done = info[0] > 0
        if rung == 0 and width < vocab and done.any():
            keep = to_device(np.flatnonzero(done), device)
            cand_vals = vals.index_select(0, keep)
            support.cand_rows = attempt[done]
            support.cand_ids = ids.index_select(0, keep)
            support.cand_logits = cand_vals.masked_fill_(cand_vals < cut.threshold[keep, None], NEG_INF)
        mass[attempt], last[attempt] = info[1], info[2]
        tried[attempt] = width
        pending = pending[~np.isin(pending, attempt[done])]
    return support


class _Cut(NamedTuple):
    threshold: torch.Tensor  # (C,) keep logits >= threshold
    resolved: torch.Tensor  # (C,) bool: the whole support lies inside the candidates
    mass: torch.Tensor  # (C,) share of the survivors' mass inside the candidates (inf: not top-p)
    last: torch.Tensor  # (C,) share of the last candidate


def _cut(
    vals: torch.Tensor,
    ids: torch.Tensor,
    rows_logits: torch.Tensor,
    threshold: torch.Tensor,
    top_k: np.ndarray,
    top_p: np.ndarray,
    use_min_p: np.ndarray,
    complete: bool,
) -> _Cut:
    """Thresholds for C rows given their K largest logits ``vals`` (descending) at ``ids``.

    ``threshold`` holds the rows' min-p thresholds; ``rows_logits`` (C, V) their whole rows, read
    only for the top-p normaliser of rows without a top-k cut. Resolved rows have their whole
    support inside the candidates: the threshold lies strictly above the last candidate (or the
    candidates are the full row).
    """
    device = vals.device
    num, width = vals.shape
    vocab = rows_logits.shape[1]
    use_top_k = (top_k > 0) & (top_k < vocab)
    use_top_p = top_p < 1.0
    mass = torch.full((num,), float("inf"), device=device)
    last = torch.zeros(num, device=device)
    if use_top_k.any():
        kth_pos = np.clip(top_k, 1, width) - 1
        kth = vals.gather(1, to_device(kth_pos, device)[:, None]).squeeze(1)
        threshold = torch.where(to_device(use_top_k, device), torch.maximum(threshold, kth), threshold)
    if use_top_p.any():
        weights = torch.exp(vals.masked_fill(vals < threshold[:, None], NEG_INF) - vals[:, :1])
        norm = weights.sum(dim=-1)
        # Without a top-k cut (and short of the full row) the survivors reach past the candidates:
        # the normaliser needs the whole row.
        full_norm = np.zeros(0, np.int64) if complete else np.flatnonzero(use_top_p & ~use_top_k)
        if full_norm.size:
            whole = full_norm.size == num
            f = to_device(full_norm, device)
            rows = rows_logits if whole else rows_logits.index_select(0, f)
            if use_min_p[full_norm].any():
                thr = threshold if whole else threshold.index_select(0, f)
                rows = rows.masked_fill(rows < thr[:, None], NEG_INF)
            # sum_i exp(l_i - l_max) = 1 / p_max: one fused log_softmax instead of sub + exp + sum.
            top_id = ids[:, :1] if whole else ids.index_select(0, f)[:, :1]
            norm[f] = torch.exp(-torch.log_softmax(rows, dim=-1).gather(1, top_id).squeeze(1))
        # Keep token i (descending) iff the mass strictly before it is < top_p: the smallest prefix
        # holding top_p of the mass, as vLLM's "drop the ascending prefix with cumsum <= 1 - p".
        cum = torch.cumsum(weights, dim=-1)
        p_mass = to_device(top_p.astype(np.float32), device) * norm
        num_keep = 1 + (cum[:, :-1] < p_mass[:, None]).sum(dim=-1)
        cut = vals.gather(1, (num_keep - 1)[:, None]).squeeze(1)
        threshold = torch.where(to_device(use_top_p, device), torch.maximum(threshold, cut), threshold)
        if full_norm.size:  # rows whose survivors may lie past the candidates: report their reach
            reaching = np.zeros(num, dtype=bool)
            reaching[full_norm] = True
            reaching_t = to_device(reaching, device)
            mass = torch.where(reaching_t, cum[:, -1] / norm, mass)
            last = torch.where(reaching_t, weights[:, -1] / norm, last)
    resolved = torch.ones(num, dtype=torch.bool, device=device) if complete else threshold > vals[:, -1]
    return _Cut(threshold, resolved, mass, last)
