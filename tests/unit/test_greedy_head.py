"""The greedy LM-head screen (``greedy_head``): the full head's argmax, index for index, without its logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nxdserve.engine.models import cpu_kernels, gemm, greedy_head
from nxdserve.engine.models.greedy_head import GreedyHead
from nxdserve.engine.models.linear import linear
from nxdserve.engine.sampling import Sampler
from nxdserve.sampling_params import SamplingParams
from tests.unit.test_sampler import make_batch

needs_screen = pytest.mark.skipif(not greedy_head.built(), reason="no AVX512-VNNI/BF16 C kernels here")


def _head(v: int, k: int, seed: int) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter((torch.randn(v, k, generator=gen) * 0.05).bfloat16(), requires_grad=False)


def _hidden(w: torch.Tensor, m: int, seed: int, outliers: tuple[int, ...] = (3, 17)) -> torch.Tensor:
    """Rows that point at some columns (peaked logits, as a trained head gives), with a few large channels
    (the final hidden state's outliers) and noise."""
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, w.shape[0], (m,), generator=gen)
    x = w.detach().float()[targets] * 40 + torch.randn(m, w.shape[1], generator=gen)
    x[:, list(outliers)] *= 25
    return x.bfloat16()


def _full_argmax(x: torch.Tensor, w: torch.Tensor, vocab: int) -> torch.Tensor:
    return cpu_kernels.argmax(linear(x, w).float()[:, :vocab])


@needs_screen
@pytest.mark.parametrize(
    ("v", "k", "vocab", "rows"),
    [
        (3000, 64, 3000, (1, 5, 8, 13, 70)),  # 70 rows: two kernel calls (MAX_ROWS 64)
        (1000, 71, 1000, (3, 9)),  # odd K: a padded bf16 pair, int8 quads padded too
        (2000, 96, 1990, (8, 33)),  # padded head: columns past the vocabulary never win
        (49152, 576, 49152, (32,)),  # the default model's shape
    ],
)
def test_screen_returns_the_full_heads_argmax(v: int, k: int, vocab: int, rows: tuple[int, ...]) -> None:
    w = _head(v, k, seed=v + k)
    head = GreedyHead(w)
    with torch.inference_mode():
        for i, m in enumerate(rows):
            x = _hidden(w, m, seed=i)
            got = head.argmax(x, vocab)
            assert got is not None and got.dtype == torch.long
            assert torch.equal(got, _full_argmax(x, w, vocab))
            assert int(got.max()) < vocab
            # The screen recomputed only part of the head (else it is no screen).
            assert 0 < head.last_recomputed < 0.5 * m * vocab


@needs_screen
def test_logits_that_round_to_one_bf16_value_go_to_the_first_column() -> None:
    # Integer weights and hidden values, so the screen's error bound is small (~2.4 here): column 10's fp32
    # logit is 4000 and column 30's 4006, and both round to bf16 4000 (spacing 16). The full head's argmax is
    # column 10, the first maximum after rounding. Without its rounding margin the screen would drop column
    # 10 (at most 4002.4, below column 30's least 4003.6) and answer 30.
    k, v = 64, 48 * 3
    w = torch.zeros(v, k)
    w[:, 0] = 1.0
    w[10, 1] = w[30, 1] = 100.0
    w[30, 2] = 3.0
    x = torch.zeros(1, k)
    x[0, :3] = torch.tensor([2000.0, 20.0, 2.0])
    weight = torch.nn.Parameter(w.bfloat16(), requires_grad=False)
    xb = x.bfloat16()
    with torch.inference_mode():
        logits = linear(xb, weight).float()
        got = GreedyHead(weight).argmax(xb, v)
    assert float(logits[0, 10]) == float(logits[0, 30]) == 4000.0
    assert int(_full_argmax(xb, weight, v)) == 10
    assert got is not None and int(got) == 10


@needs_screen
def test_equal_columns_give_the_first_index() -> None:
    w = _head(500, 64, seed=1).detach().clone()
    w[450] = w[7]
    w[20] = w[300]
    weight = torch.nn.Parameter(w, requires_grad=False)
    x = torch.stack([w[7].float() * 40, w[300].float() * 40]).bfloat16()
    with torch.inference_mode():
        got = GreedyHead(weight).argmax(x, 500)
    assert got is not None and got.tolist() == _full_argmax(x, weight, 500).tolist() == [7, 20]


@needs_screen
def test_a_row_that_is_not_finite_leaves_the_step_to_the_full_head() -> None:
    w = _head(500, 64, seed=2)
    x = _hidden(w, 4, seed=0)
    x[2, 5] = float("inf")
    with torch.inference_mode():
        assert GreedyHead(w).argmax(x, 500) is None


@needs_screen
def test_a_screen_that_recomputes_too_much_turns_itself_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # Logits too close together for int8 to tell apart make the screen recompute much of the head (random
    # heads at K=576: about half of it); after a few such calls it stops answering. Here any recomputation
    # counts as too much.
    monkeypatch.setattr(greedy_head, "POOR_FRACTION", 0.0)
    w = _head(3000, 64, seed=3)
    head = GreedyHead(w)
    gen = torch.Generator().manual_seed(0)
    answers = []
    with torch.inference_mode():
        for _ in range(greedy_head.POOR_CALLS + 2):
            x = torch.randn(8, 64, generator=gen).bfloat16()
            got = head.argmax(x, 3000)
            if got is not None:
                assert torch.equal(got, _full_argmax(x, w, 3000))
            answers.append(got is not None)
    assert answers[: greedy_head.POOR_CALLS] == [True] * greedy_head.POOR_CALLS
    assert head.disabled and not any(answers[greedy_head.POOR_CALLS :])


@needs_screen
def test_an_updated_weight_is_packed_again() -> None:
    w = _head(1000, 64, seed=4)
    head = GreedyHead(w)
    x = _hidden(w, 8, seed=1)
    with torch.inference_mode():
        assert torch.equal(head.argmax(x, 1000), _full_argmax(x, w, 1000))
    with torch.no_grad():
        w.copy_(torch.flip(w, dims=[0]))  # in place, as loading does: column i is now old column 999 - i
    with torch.inference_mode():
        got = head.argmax(x, 1000)
        assert got is not None and torch.equal(got, _full_argmax(x, w, 1000))


def test_plain_greedy_is_what_sample_answers_with_one_argmax() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, min_tokens=4),
        SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
    ]
    batch = make_batch(params, stop_ids=[[2]] * len(params))  # min_tokens masks stop tokens: it needs some
    sampler = Sampler(vocab_size=12, device=torch.device("cpu"))
    assert sampler.plain_greedy(np.array([0]), batch)
    for slot in range(1, len(params)):
        assert not sampler.plain_greedy(np.array([0, slot]), batch), params[slot]


@needs_screen
@pytest.mark.skipif(not gemm.uses_amx(), reason="no AMX-BF16 on this machine")
def test_screen_recomputes_with_whichever_tile_the_full_head_uses() -> None:
    """On AMX the full head's bits are the tiles'; with AMX switched off, the AVX512 tile's. The two sum a
    pair of products in different orders: column 0's terms 2^24, 1, -2^24, 1 give 2 on the tiles and 0 on the
    AVX512 tile, so column 0 (tiles) or column 1 (logit 1, AVX512) is the full head's argmax. The candidates'
    recompute must follow, or the screen answers the other column."""
    lib = cpu_kernels._library()
    assert lib is not None
    w = torch.zeros(144, 64)
    w[0, :4] = torch.tensor([4096.0, 1.0, -4096.0, 1.0])
    w[1, 1] = 1.0
    weight = torch.nn.Parameter(w.bfloat16(), requires_grad=False)
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([4096.0, 1.0, 4096.0, 1.0])
    x = x.bfloat16()
    with torch.inference_mode():
        on_tiles = GreedyHead(weight).argmax(x, 144)
        assert on_tiles is not None and torch.equal(on_tiles, _full_argmax(x, weight, 144))
        assert on_tiles.tolist() == [0]
        try:
            lib.gemm_set_amx(0)
            on_avx512 = GreedyHead(weight).argmax(x, 144)
            assert on_avx512 is not None and torch.equal(on_avx512, _full_argmax(x, weight, 144))
            assert on_avx512.tolist() == [1]
        finally:
            lib.gemm_set_amx(1)
