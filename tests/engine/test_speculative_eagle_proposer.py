"""EagleProposer internals: the head's direct attention metadata, the truncated draft vocabulary and the
two confidence bars (draft 1, and the chain), on a small random head with a stand-in target."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nxdserve.engine.speculative.base import DraftRows
from nxdserve.engine.speculative.config import SpeculativeConfig
from nxdserve.engine.speculative.eagle import EagleProposer
from nxdserve.engine.speculative.eagle_head import EAGLE_CONFIG_KEY, EagleHead
from tests.engine.test_speculative_eagle import HIDDEN, MAX_LEN, VOCAB, make_head

SLOTS = 6


def make_proposer(
    *,
    vocab_ids: list[int] | None = None,
    k: int = 3,
    first: float | None = None,
    chain: float | None = None,
    dtype: torch.dtype = torch.float32,
    target_dtype: torch.dtype | None = None,
) -> EagleProposer:
    reference = make_head(seed=5, input_norm=True)
    head = EagleHead(reference.config, dtype, torch.device("cpu"), MAX_LEN)
    head.load_checkpoint_tensors(reference.named_checkpoint_tensors())
    if vocab_ids is not None:
        head.draft_vocab_ids = torch.tensor(vocab_ids)
    eagle = head.config[EAGLE_CONFIG_KEY]
    if chain is not None:
        eagle["min_draft_confidence"] = chain
    if first is not None:
        eagle["min_first_draft_confidence"] = first
    g = torch.Generator().manual_seed(11)
    target = SimpleNamespace(
        spec=SimpleNamespace(hidden_size=HIDDEN),
        device=torch.device("cpu"),
        embed_weight=torch.randn(VOCAB, HIDDEN, generator=g).to(target_dtype or dtype),
        lm_head_weight=torch.randn(VOCAB, HIDDEN, generator=g).to(target_dtype or dtype),
    )
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=k, model="unused")
    return EagleProposer(spec, MAX_LEN, SLOTS, head, target)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_metadata_gives_what_the_built_metadata_gives(dtype: torch.dtype) -> None:
    """The head's attention metadata made directly (the CPU kernel path) and by AttentionMetadata.build:
    the same outputs and the same cache, over multi-token rows in several slots and single-token steps."""
    direct, built = make_proposer(dtype=dtype), make_proposer(dtype=dtype)
    if not direct._direct_metadata:
        pytest.skip("the CPU attention kernel is not available here")
    built._direct_metadata = False
    g = torch.Generator().manual_seed(3)
    steps: list[tuple[list[int], list[int], list[int]]] = [
        ([2, 0], [0, 0], [7, 5]),  # two prefill-like rows
        ([0, 2, 3], [5, 7, 0], [2, 1, 3]),  # verification-like rows and a new slot
        ([3], [3], [1]),  # one row, one token: the chained draft step
        ([1], [0], [4]),  # one row, several tokens
    ]
    for slots, starts, lens in steps:
        n = sum(lens)
        tokens = torch.randint(0, VOCAB, (n,), generator=g)
        feats = torch.randn(n, HIDDEN, generator=g).to(dtype)
        args = (np.asarray(slots, dtype=np.int64), np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64))
        with torch.inference_mode():
            a = direct._run(tokens, feats, *args)
            b = built._run(tokens, feats, *args)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(direct.kv_cache.data, built.kv_cache.data, rtol=0, atol=0)


@pytest.mark.parametrize("vocab_ids", [None, [41, 7, 90, 3]])
def test_head_in_its_own_dtype_drafts_beside_a_bf16_target(vocab_ids: list[int] | None) -> None:
    """draft_dtype float32 beside a bf16 target: the head runs on the target's bf16 features and scores
    with an fp32 copy of the LM head (mixing the two dtypes in one matmul raised on every step)."""
    proposer = make_proposer(
        dtype=torch.float32, target_dtype=torch.bfloat16, vocab_ids=vocab_ids, first=0.0, chain=0.0
    )
    assert proposer.lm_weight.dtype == torch.float32
    g = torch.Generator().manual_seed(8)
    slots, starts, lens = (np.array([1]), np.array([0]), np.array([6]))
    with torch.inference_mode():
        feats = torch.randn(6, HIDDEN, generator=g).to(torch.bfloat16).to(proposer.head.dtype)
        out = proposer._run(torch.randint(0, VOCAB, (6,), generator=g), feats, slots, starts, lens)
        proposer.last_hidden[1] = out[-1]
        proposer.last_pos[1] = 5
        drafts, lengths = proposer.draft(
            DraftRows(requests=[None], slots=slots, num_tokens=np.array([7]), k=np.array([3])), None  # type: ignore[list-item, arg-type]
        )
    assert lengths.tolist() == [3]
    assert all(0 <= t < VOCAB for t in drafts[0].tolist())
    if vocab_ids is not None:
        assert set(drafts[0].tolist()) <= set(vocab_ids)


def test_truncated_vocabulary_maps_drafts_back_to_target_ids() -> None:
    """The head scores only its draft vocabulary (rows of the target's LM head, gathered once) and
    returns full-vocabulary ids with the probability over the truncated set."""
    vocab_ids = [41, 7, 90, 3, 55, 12, 68, 29]
    proposer = make_proposer(vocab_ids=vocab_ids)
    assert proposer.lm_weight.shape == (len(vocab_ids), HIDDEN) and proposer.lm_weight.is_contiguous()
    h = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ids, conf = proposer._argmax(h)
    full = F.linear(h, make_proposer().lm_weight)  # the same target LM head, not truncated
    sub_logits = full[:, vocab_ids]
    expected = torch.tensor(vocab_ids)[sub_logits.argmax(-1)]
    assert ids.tolist() == expected.tolist()
    assert set(ids.tolist()) <= set(vocab_ids)
    torch.testing.assert_close(conf, torch.softmax(sub_logits, -1).max(-1).values)


def test_head_without_a_draft_vocabulary_scores_the_whole_vocabulary() -> None:
    proposer = make_proposer()
    assert proposer.vocab_ids is None and proposer.lm_weight.shape == (VOCAB, HIDDEN)
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        ids, conf = proposer._argmax(h)
    logits = F.linear(h, proposer.lm_weight)
    assert ids.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(conf, torch.softmax(logits, -1).max(-1).values)


class _Scripted:
    """Stands in for the head: each call's confidences per active row, in row order."""

    def __init__(self, proposer: EagleProposer, confidences: list[list[float]]) -> None:
        self.confidences = confidences
        self.calls = 0
        self.run_rows: list[int] = []
        proposer._argmax = self.argmax  # type: ignore[method-assign]
        proposer._run = self.run  # type: ignore[method-assign]

    def argmax(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        conf = torch.tensor(self.confidences[self.calls][: h.shape[0]])
        self.calls += 1
        return torch.full((h.shape[0],), 10 * self.calls), conf

    def run(self, tokens: torch.Tensor, features: torch.Tensor, *rest: Any) -> torch.Tensor:
        self.run_rows.append(int(tokens.shape[0]))
        return features


def draft_rows(proposer: EagleProposer, ks: list[int]) -> DraftRows:
    slots = np.arange(len(ks), dtype=np.int64)
    n = np.full(len(ks), 20, dtype=np.int64)
    proposer.last_pos[slots] = n - 2  # every row's head cache is caught up
    return DraftRows(requests=[None] * len(ks), slots=slots, num_tokens=n, k=np.asarray(ks, dtype=np.int64))  # type: ignore[list-item]


def test_first_draft_and_chain_have_their_own_confidence_bars() -> None:
    """Draft 1 needs min_first_draft_confidence; draft j >= 2 needs the product over drafts 1..j at
    min_draft_confidence, and a chain step runs only for rows that can still reach it."""
    proposer = make_proposer(first=0.1, chain=0.4, k=3)
    # Rows: too unsure for any draft; draft 1 only (below the chain bar); chain stops after draft 2
    # (0.9 * 0.5 = 0.45, then * 0.5 < 0.4); chain to 3 (0.9 * 0.9 * 0.9 = 0.73); k_r = 1.
    script = _Scripted(proposer, [[0.05, 0.3, 0.9, 0.9, 0.95], [0.5, 0.9], [0.5, 0.9]])
    drafts, lengths = proposer.draft(draft_rows(proposer, [3, 3, 3, 3, 1]), None)  # type: ignore[arg-type]
    assert lengths.tolist() == [0, 1, 2, 3, 1]
    assert script.run_rows == [2, 2]  # rows 2 and 3 chain twice; row 2's last draft is cut afterwards
    assert drafts[1, 0] == 10 and drafts[3].tolist() == [10, 20, 30]


def test_heads_without_a_first_draft_bar_use_the_chain_bar_for_draft_one() -> None:
    proposer = make_proposer(chain=0.4, k=2)
    assert proposer.min_first_confidence == proposer.min_confidence == 0.4
    _Scripted(proposer, [[0.3, 0.5], [0.9]])
    _, lengths = proposer.draft(draft_rows(proposer, [2, 2]), None)  # type: ignore[arg-type]
    assert lengths.tolist() == [0, 2]


def test_heads_without_any_bar_always_draft_k() -> None:
    proposer = make_proposer(k=3)
    proposer.head.config[EAGLE_CONFIG_KEY].pop("min_draft_confidence", None)
    assert proposer.min_confidence == 0.0 and proposer.min_first_confidence == 0.0
    _Scripted(proposer, [[0.01, 0.02], [0.01, 0.02], [0.01, 0.02]])
    _, lengths = proposer.draft(draft_rows(proposer, [3, 2]), None)  # type: ignore[arg-type]
    assert lengths.tolist() == [3, 2]
