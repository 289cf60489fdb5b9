"""A bf16 model with quantized linears: steps of more than ``quant.dense_rows`` tokens run through the fused bf16
C forward on the weights' dense bf16 copies (fused_decode.py), smaller ones keep the quantized kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nxdserve.engine.models import fused_decode, quant
from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.engine.models.runner import SlotModelRunner
from tests.helpers.fused_runs import record_fused_runs
from tests.helpers.tiny_model import tiny_model_path

LINEARS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


def _model() -> LlamaFamilyModel:
    return LlamaFamilyModel.from_pretrained(tiny_model_path("llama"), torch.bfloat16, torch.device("cpu"), max_len=96)


def test_large_steps_of_a_quantized_bf16_model_are_the_fused_forward_of_its_dense_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The quantized model's 30-token prefill gives bit for bit the fused forward of a dense bf16 model holding
    the dequantized weights; a 2-row decode step stays on the quantized kernels; both are close to the layer
    path's results."""
    if not fused_decode.available():
        pytest.skip("the fused bf16 C forward is not built on this machine")
    quantized, dense = _model(), _model()
    quant.quantize_model(quantized, "int8")
    for q_layer, d_layer in zip(quantized.layers, dense.layers, strict=True):
        for name in LINEARS:
            weight = getattr(q_layer, name)
            assert isinstance(weight, quant.QuantLinear)
            getattr(d_layer, name).data.copy_(weight.dequantize(torch.bfloat16))
    fused_sizes = record_fused_runs(monkeypatch)
    tokens = torch.randint(3, 1000, (30,), generator=torch.Generator().manual_seed(0))

    def prefill_then_decode(model: LlamaFamilyModel) -> tuple[torch.Tensor, torch.Tensor]:
        runner = SlotModelRunner(model, 2, 96)
        prefill = runner.run(tokens, np.array([0]), np.array([0]), np.array([30]))
        runner.run(tokens[:5], np.array([1]), np.array([0]), np.array([5]))
        decode = runner.run(torch.tensor([11, 12]), np.array([0, 1]), np.array([30, 5]), np.array([1, 1]))
        return prefill, decode

    with torch.inference_mode():
        q_prefill, q_decode = prefill_then_decode(quantized)
        assert fused_sizes == [30]  # the 5-token prefill and the 2-row decode took the quantized kernels
        fused_sizes.clear()
        d_prefill, _ = prefill_then_decode(dense)
        assert torch.equal(q_prefill, d_prefill)
        monkeypatch.setattr(fused_decode, "enabled", False)
        fused_sizes.clear()
        l_prefill, l_decode = prefill_then_decode(quantized)
        assert not fused_sizes
    # final-normed bf16 states of O(1): the two paths round their sums differently, a few bf16 ulps apart
    torch.testing.assert_close(q_prefill.float(), l_prefill.float(), rtol=5e-2, atol=8e-2)
    torch.testing.assert_close(q_decode.float(), l_decode.float(), rtol=5e-2, atol=8e-2)
