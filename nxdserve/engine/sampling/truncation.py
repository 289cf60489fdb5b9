"""min-p, top-k and top-p as one per-row logit threshold.

Each row keeps the tokens whose (temperature-scaled) logit is >= its threshold, so every
truncation becomes one comparison against a (R,) vector. Semantics follow vLLM V1: min-p first
(relative to the most likely token), then top-k, then top-p over the renormalised survivors,
always keeping the most likely token. Ties at a cut are all kept (thresholds are by value), which
makes the result independent of how a sort orders equal logits.

Finding the top-k/top-p cut needs the row in descending order. A full sort of a 50k vocabulary is
slow on CPU (about 60 ms for 32 rows), and the mass of a real LLM distribution sits in a few dozen
tokens, so rows are tried against a ladder of ``topk`` candidate sets first; a row whose cut is not
provably inside its candidates moves up the ladder, and the last rung is a full sort of only those
rows. On an accelerator a ladder of ``()`` gives plain one-sort behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    for rung, size in enumerate((*ladder, vocab)):
        if pending.size == 0:
            break
        width = min(vocab, max(size, k_max + 1))
        idx = to_device(pending, device)
        sub = logits if pending.size == num_rows else logits.index_select(0, idx)
        if width == vocab:
            vals, ids = sub.sort(dim=-1, descending=True)
        else:
            vals, ids = sub.topk(width, dim=-1)
        row_thr, resolved = _cut(vals, sub, threshold[idx], top_k[pending], top_p[pending], width == vocab)
        threshold[idx] = row_thr
        done = resolved.cpu().numpy()
        if rung == 0 and width < vocab and done.any():
            keep = to_device(np.flatnonzero(done), device)
            cand_vals = vals.index_select(0, keep)
            support.cand_rows = pending[done]
            support.cand_ids = ids.index_select(0, keep)
            support.cand_logits = cand_vals.masked_fill_(cand_vals < row_thr[keep, None], NEG_INF)
        pending = pending[~done]
    return support


def _cut(
    vals: torch.Tensor,
    rows_logits: torch.Tensor,
    threshold: torch.Tensor,
    top_k: np.ndarray,
    top_p: np.ndarray,
    complete: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Thresholds for rows given their K largest logits ``vals`` (descending).

    Returns (threshold, resolved): resolved rows have their whole support inside the candidates,
    i.e. the threshold lies strictly above the last candidate (or the candidates are the full row).
    """
    device = vals.device
    width = vals.shape[1]
    vocab = rows_logits.shape[1]
    use_top_k = (top_k > 0) & (top_k < vocab)
    use_top_p = top_p < 1.0
    if use_top_k.any():
        kth_pos = np.clip(top_k, 1, width) - 1
        kth = vals.gather(1, to_device(kth_pos, device)[:, None]).squeeze(1)
        threshold = torch.where(to_device(use_top_k, device), torch.maximum(threshold, kth), threshold)
    if use_top_p.any():
        top = vals[:, :1]
        weights = torch.exp(vals.masked_fill(vals < threshold[:, None], NEG_INF) - top)
        norm = weights.sum(dim=-1)
        # Without a top-k cut (and short of the full row) the survivors reach past the candidates:
        # the normaliser needs the whole row.
        full_norm = np.flatnonzero(use_top_p & ~use_top_k) if not complete else np.zeros(0, np.int64)
        if full_norm.size:
            f = to_device(full_norm, device)
            rows = rows_logits.index_select(0, f)
            e = torch.exp(rows - top.index_select(0, f))
            e.masked_fill_(rows < threshold.index_select(0, f)[:, None], 0.0)
            norm[f] = e.sum(dim=-1)
        # Keep token i (descending) iff the mass strictly before it is < top_p: the smallest prefix
        # holding top_p of the mass, as vLLM's "drop the ascending prefix with cumsum <= 1 - p".
        before = torch.cumsum(weights, dim=-1)[:, :-1]
        p_mass = to_device(top_p.astype(np.float32), device)[:, None] * norm[:, None]
        num_keep = 1 + (before < p_mass).sum(dim=-1)
        cut = vals.gather(1, (num_keep - 1)[:, None]).squeeze(1)
        threshold = torch.where(to_device(use_top_p, device), torch.maximum(threshold, cut), threshold)
    if complete:
        resolved = torch.ones(vals.shape[0], dtype=torch.bool, device=device)
    else:
        resolved = threshold > vals[:, -1]
    return threshold, resolved
