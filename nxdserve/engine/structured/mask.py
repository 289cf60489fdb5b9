"""Token bitmasks: 32 tokens per int32 word, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed
(llguidance's and xgrammar's layout)."""

from __future__ import annotations

import sys
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

# byte -> its 8 bits, lowest first: unpacking is one gather over the mask's bytes (~3x fewer operations than
# shifting each int32 word 32 times).
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()
assert sys.byteorder == "little", "bitmask words are read as little-endian bytes"


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(P, W) int32 words -> (P, vocab) bool allowed-token table."""
    table = _BYTE_BITS.to(bitmask.device)
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # (P, 4W), little-endian: byte k = bits 8k..8k+7
    return table[as_bytes].reshape(bitmask.shape[0], -1)[:, :vocab]


@dataclass
class TokenMask:
    """Allowed tokens for some rows of a 2-D logits tensor: ``bitmask[k]`` applies to row ``rows[k]``."""

    rows: np.ndarray  # (P,) int64 indices into the logits' rows
    bitmask: torch.Tensor  # (P, W) int32

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """A private fp32 copy of 2-D ``logits`` with every disallowed token at -inf (one vectorised write for all
        constrained rows). The caller's tensor is untouched: logprobs stay those of the model."""
        out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
        device = out.device
        rows = torch.from_numpy(self.rows).to(device)
        allowed = unpack_bitmask(self.bitmask.to(device, non_blocking=True), out.shape[1])
        sub = out.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
        out.index_copy_(0, rows, sub)
        return out


@dataclass
class StepTokenMask:
    """A step's constrained positions, in plan terms: bitmask row k is for plan row ``rows[k]`` at verification
    position ``positions[k]`` (0: the row's first sampled position; j: after its first j drafts).

    The bitmask may still be being filled (``ready``) while the model's forward runs: reading ``bitmask`` waits."""

    rows: np.ndarray  # (P,) int64 plan rows, ascending, each row's positions consecutive
    positions: np.ndarray  # (P,) int64
    filled: torch.Tensor  # (P, W) int32
    ready: Future[None] | None = field(default=None, repr=False)

    @property
    def bitmask(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.result()  # re-raises a failed fill
        return self.filled

    def restrict(self, rows: np.ndarray) -> StepTokenMask:
        """The entries of plan rows ``rows`` only (a backend that samples some rows in one place, some in another)."""
        keep = np.isin(self.rows, rows)
        index = torch.from_numpy(np.flatnonzero(keep))
        return StepTokenMask(rows=self.rows[keep], positions=self.positions[keep], filled=self.bitmask[index])

    def for_logits(self, sampled_rows: np.ndarray, width: int) -> TokenMask:
        """The mask over a backend's logits of its sampled rows (plan rows ``sampled_rows``, ascending), laid out
        (len(sampled_rows) * width) rows deep: logits row ``i * width + j`` is sampled row i at position j."""
        index = np.searchsorted(sampled_rows, self.rows)
        if not (index < sampled_rows.size).all() or not (sampled_rows[np.minimum(index, sampled_rows.size - 1)]
                                                        == self.rows).all():
            raise ValueError("a constrained row does not sample in this step")
        return TokenMask(rows=index * width + self.positions, bitmask=self.bitmask)
