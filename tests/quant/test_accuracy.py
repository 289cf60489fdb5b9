"""Accuracy of the weight formats (issue 29 item 5): the quantizers' error, and perplexity on the shipped sample
texts (pooled: one ~400-token text alone moved by up to 0.4% between machines, perplexity.py says why).

The figures per format are ``benchmarks/quant_accuracy.py``'s; docs/quantization.md ("Accuracy") has them.
"""

from __future__ import annotations

import pytest
import torch

from nxdserve.engine.models import quant
from nxdserve.engine.models.perplexity import perplexity, sample_texts, texts_logits, top1_agreement


def _weight(rows: int = 64, cols: int = 256) -> torch.Tensor:
    """A weight with a few outlier input columns, as real linears have."""
    torch.manual_seed(0)
    weight = torch.randn(rows, cols) * 0.05
    weight[:, ::37] *= 8
    return weight


def test_fp8_keeps_a_searched_scale_per_32_columns() -> None:
    weight = _weight()
    q = quant.quantize_fp8(weight)
    assert q.kind == "fp8" and q.group == 32 and q.data.dtype == torch.float8_e4m3fn
    assert q.scales.shape == (64, 256 // 32)
    blocks = weight.view(64, 8, 32)
    # Each scale lies in the octave above its block's absmax / 448, so no code clips.
    ratio = q.scales / (blocks.abs().amax(2) / quant.FP8_MAX)
    assert torch.all(ratio >= 1) and torch.all(ratio < 2)
    dense = q.dequantize()
    expected = (q.data.float().view(64, 8, 32) * q.scales[..., None]).view(64, 256)
    torch.testing.assert_close(dense, expected, rtol=0, atol=0)
    # Less squared error than one absmax scale per row (the former format), and within e4m3's half step.
    row_scale = weight.abs().amax(1, keepdim=True) / quant.FP8_MAX
    per_row = (weight / row_scale).to(torch.float8_e4m3fn).float() * row_scale
    assert float((dense - weight).square().sum()) < 0.8 * float((per_row - weight).square().sum())
    assert torch.all((dense - weight).abs() <= weight.abs() * 2.0**-4 + q.scales.amax() * 2.0**-10)
    x = torch.randn(3, 256)
    torch.testing.assert_close(q(x), x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_fp8_falls_back_to_a_scale_per_row_when_32_does_not_divide_the_inputs() -> None:
    weight = _weight(cols=200)
    q = quant.quantize_fp8(weight)
    assert q.group == 0 and q.scales.shape == (64,)
    torch.testing.assert_close(q.dequantize(), q.data.float() * q.scales[:, None], rtol=0, atol=0)


def test_int4_search_recovers_weights_already_on_a_4_bit_grid() -> None:
    """Weights on a 16-level grid per group (a Q4_1 file's): the search finds the grid, round-to-nearest too."""
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (32, 128)).float()
    codes[:, ::32], codes[:, 1::32] = 0, 15  # every group spans the whole code range
    step, low = torch.rand(32, 4, 1) * 0.01 + 1e-3, torch.randn(32, 4, 1) * 0.05
    weight = (codes.view(32, 4, 32) * step + low).view(32, 128)
    for search in (True, False):
        dense = quant.quantize_int4(weight, 32, search=search).dequantize()
        torch.testing.assert_close(dense, weight, rtol=0, atol=1e-6)


@pytest.mark.parametrize("group", quant.INT4_GROUPS)
def test_int4_search_has_less_squared_error_than_round_to_nearest(group: int) -> None:
    weight = _weight(cols=320)  # 320: padded at groups of 64 / 128
    searched = quant.quantize_int4(weight, group).dequantize()
    rtn = quant.quantize_int4(weight, group, search=False).dequantize()
    assert float((searched - weight).square().sum()) < 0.95 * float((rtn - weight).square().sum())
    # rtn keeps vLLM's meaning: plain round-to-nearest (the search's codes differ).
    rtn_method = quant.quantize(weight[:, :256], "rtn").dequantize()
    plain = quant.quantize_int4(weight[:, :256], 128, search=False).dequantize()
    torch.testing.assert_close(rtn_method, plain, rtol=0, atol=0)


Sample = tuple[list[list[int]], list[torch.Tensor]]


@pytest.fixture(scope="module")
def sample() -> Sample:
    texts = sample_texts()
    assert len(texts) == 3 and all(300 <= len(ids) <= 512 for ids in texts)  # each one prefill of the model
    return texts, texts_logits("bf16", texts)


def test_int8_within_one_percent_of_bf16_perplexity(sample: Sample) -> None:
    """The default suite's bound check (int8: the cheapest format to build; the others are in the slow test)."""
    texts, reference = sample
    logits = texts_logits("int8", texts)
    assert abs(perplexity(logits, texts) / perplexity(reference, texts) - 1) < 0.01
    assert top1_agreement(logits, reference) > 0.9


def test_int4_group_64_within_ten_percent_of_bf16_perplexity(sample: Sample) -> None:
    """Group 64 (the activation-weighted search and bias correction, calibrated at load: a few seconds) within the
    issue's 10% (+8.74% measured)."""
    texts, reference = sample
    ppl = perplexity(texts_logits("int4-g64", texts), texts)
    assert ppl / perplexity(reference, texts) - 1 < 0.10


def test_pooled_perplexity_weighs_every_token_the_same() -> None:
    """Two texts pooled: exp of the mean over all their tokens, not the mean of their perplexities."""
    torch.manual_seed(2)
    texts = [[1, 2, 3, 4], [5, 6]]
    logits = [torch.randn(4, 8), torch.randn(2, 8)]
    nll = [
        -torch.log_softmax(lg[:-1], -1)[torch.arange(len(ids) - 1), ids[1:]]
        for lg, ids in zip(logits, texts, strict=True)
    ]
    assert perplexity(logits, texts) == pytest.approx(float(torch.exp(torch.cat(nll).mean())), rel=1e-6)
    assert perplexity(logits[0], texts[0]) == pytest.approx(float(torch.exp(nll[0].mean())), rel=1e-6)
    with pytest.raises(ValueError, match="2 logits for 1 texts"):
        perplexity(logits, texts[:1])


@pytest.mark.slow  # minutes: six quantized default models, two of them calibrated at load
def test_each_format_within_its_perplexity_bound(sample: Sample) -> None:
    """fp8 within 1% of the bf16 model's perplexity (per-row scales measured 1.9%), the 4-bit default (group 32)
    within 10%, the file's own GGUF blocks within 1% (they are the weights the dense model expands), group 64
    (calibrated at load, bias-corrected) within 10% (the default suite checks it too), group 128 (awq.py's
    activation-aware scales, then qtune.py's tuning of its scales against the dense model: minutes) within 10%
    (+7.68% on the three texts pooled; +8.06% on the first alone, +14.47% untuned there), and it beats plain
    round-to-nearest (``rtn``)."""
    texts, reference = sample
    ref = perplexity(reference, texts)
    formats = ("fp8", "int4", "gguf", "int4-g64", "int4-g128", "rtn")
    ppl = {fmt: perplexity(texts_logits(fmt, texts), texts) for fmt in formats}
    for fmt, bound in (("fp8", 0.01), ("int4", 0.10), ("gguf", 0.01), ("int4-g64", 0.10), ("int4-g128", 0.10)):
        assert abs(ppl[fmt] / ref - 1) < bound, (fmt, ppl[fmt], ref)
    assert ppl["int4-g128"] < ppl["rtn"]
