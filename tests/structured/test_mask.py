"""Token bitmasks: unpacking matches the packed layout bit for bit; masks map from plan rows to logits rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nxdserve.engine.structured.mask import StepTokenMask, TokenMask, unpack_bitmask


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """(P, V) bool -> (P, ceil(V/32)) int32, bit t % 32 of word t // 32."""
    p, v = allowed.shape
    words = (v + 31) // 32
    bits = torch.zeros(p, words * 32, dtype=torch.int64)
    bits[:, :v] = allowed.long()
    packed = (bits.view(p, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000])
def test_unpack_inverts_pack(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(5, vocab, generator=g) < 0.5
    allowed[0] = True  # every bit set: word -1
    assert torch.equal(unpack_bitmask(_pack(allowed), vocab), allowed)


def test_masked_copy_leaves_the_input_and_other_rows() -> None:
    logits = torch.randn(3, 40)
    allowed = torch.zeros(1, 40, dtype=torch.bool)
    allowed[0, [3, 39]] = True
    out = TokenMask(rows=np.array([1]), bitmask=_pack(allowed)).masked(logits)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    assert torch.isinf(out[1]).sum() == 38 and out[1, 3] == logits[1, 3] and out[1, 39] == logits[1, 39]
    assert not torch.isinf(logits).any()


def test_step_mask_maps_plan_rows_to_logits_rows() -> None:
    bitmask = torch.arange(4, dtype=torch.int32)[:, None].repeat(1, 2)
    step = StepTokenMask(rows=np.array([1, 1, 3, 4]), positions=np.array([0, 1, 0, 0]), filled=bitmask)
    mask = step.for_logits(np.array([0, 1, 3, 4]), width=2)
    assert mask.rows.tolist() == [2, 3, 4, 6]
    sub = step.restrict(np.array([3, 4]))
    assert sub.rows.tolist() == [3, 4] and sub.bitmask[:, 0].tolist() == [2, 3]
    with pytest.raises(ValueError):
        step.for_logits(np.array([0, 1]), width=2)
