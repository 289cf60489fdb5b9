"""Speculative-decoding verification math (arXiv 2211.17192, as vLLM's RejectionSampler).

Terms: a row's drafts are accepted left to right until the first rejection; the row then emits one
more token, the *recovered* token (sampled from the residual at the rejected position) or, when every
draft was accepted, the *bonus* token (sampled from the target at position num_drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DraftLayout:
    """The verified positions flattened: one logits row per (batch row i, position j <= nd[i])."""

    src: np.ndarray  # (R,) batch row of each flat row
    pos: np.ndarray  # (R,) position j of each flat row
    first: np.ndarray  # (N,) flat row of each batch row's position 0

    @classmethod
    def build(cls, num_drafts: np.ndarray) -> DraftLayout:
        per_row = num_drafts + 1
        src = np.repeat(np.arange(num_drafts.shape[0], dtype=np.int64), per_row)
        first = np.cumsum(per_row) - per_row
        pos = np.arange(src.shape[0], dtype=np.int64) - np.repeat(first, per_row)
        return cls(src=src, pos=pos, first=first)

    @property
    def num_positions(self) -> int:
        return int(self.src.shape[0])

    def judged(self, num_drafts: np.ndarray) -> np.ndarray:
        """Flat rows that judge a draft (every position but each row's last)."""
        return np.flatnonzero(self.pos < num_drafts[self.src])


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """(N, D) per-draft accept flags -> (N,) int64 length of the all-accepted prefix."""
    if accept.shape[1] == 0:
        return torch.zeros(accept.shape[0], dtype=torch.long, device=accept.device)
    return accept.to(torch.int32).cumprod(dim=1).sum(dim=1).to(torch.long)


def accept_random(p_target: torch.Tensor, p_draft: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Accept draft x iff p_draft(x) > 0 and u <= p_target(x) / p_draft(x) (no division).

    ``p_target``/``p_draft`` are the probabilities of the draft token itself; ``p_draft`` None means
    point proposals (n-gram, greedy drafting): p_draft(x) = 1.
    """
    if p_draft is None:
        return p_target >= u
    return (p_draft > 0) & (p_target >= u * p_draft)


def residual(
    p_target: torch.Tensor,
    rejected: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_ids: torch.Tensor,
) -> torch.Tensor:
    """The distribution (unnormalised) of each row's final token.

    ``p_target`` (M, V) is the target at the final position; for ``rejected`` rows it becomes
    max(p_target - p_draft, 0), with p_draft one-hot at the draft id for point proposals. Bonus rows
    keep p_target. A residual that vanishes (p_target == p_draft up to rounding, so the rejection
    was a rounding artefact) falls back to p_target, which keeps the output distribution exact.
    """
    keep = ~rejected[:, None]
    if draft_probs is None:
        # Rows without drafts (bonus rows) carry the -1 pad here; any valid index works for them since
        # ``keep`` writes their value back unchanged.
        index = draft_ids.clamp(min=0)[:, None]
        at_draft = p_target.gather(1, index)
        resid = p_target.scatter(1, index, at_draft * keep)
    else:
        resid = (p_target - draft_probs.masked_fill(keep, 0.0)).clamp_(min=0.0)
    empty = resid.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p_target, resid)


def assemble(draft_ids: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor, width: int) -> torch.Tensor:
    """(N, width) output ids: accepted drafts, then the final token, then -1 padding."""
    n = draft_ids.shape[0]
    out = torch.full((n, width), -1, dtype=torch.long, device=final.device)
    d = draft_ids.shape[1]
    if d:
        positions = torch.arange(d, device=final.device)[None, :]
        out[:, :d] = torch.where(positions < num_accepted[:, None], draft_ids, -1)
    return out.scatter_(1, num_accepted[:, None], final[:, None])
