"""Activation-weighted 4-bit groups (llama.cpp's "imatrix", the importance weighting AWQ also builds on): the scale
search of ``quant.quantize_int4`` with each weight's squared error weighted by the mean square of its input
channel on a calibration text, so the grid fits the weights that large activations multiply.

At group 64 each quantized linear also gets a bias that cancels its mean output error on the calibration
(``correct_bias``; measured in ``BIAS_CORRECTED_GROUPS``' comment).

The calibration is ``gptq.CALIBRATION`` (~1000 tokens, disjoint from the perplexity sample), run once through the
dense model at load: one prefill of it (for the default model ~4 s on a 2-core AVX2 machine; for a 7B model on a
CPU, about its FLOPs per token x 1000, minutes), then the search itself, as fast as the plain one (``csrc/qsearch.c``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from nxdserve.engine.models import gptq, quant

logger = logging.getLogger(__name__)

FLOOR = 1e-3  # importance floor, times the linear's mean: channels the calibration never drives still count
# Not done: re-rounding and refitting each group's searched grid by weighted least squares (4 rounds) measured
# +11.26% -> +11.04% perplexity at group 64 (+17.52% -> +17.20% at 128), within the sample's noise, for several
# times the load time (perf_notes.md, issue 29 item 5).


# Groups whose quantized linears get a bias that cancels their mean output error on the calibration text
# (``correct_bias``). Measured on the default model, perplexity against bf16: group 64 +11.55% -> +9.56% on the
# shipped sample, and on two other held-out texts (500 tokens of README.md / docs/speculative.md) +8.81% -> +7.88%
# and +6.51% -> +6.47%; group 128 (weighted search alone) +17.82% -> +18.60%, and with awq.py's scales +14.46% ->
# +16.22%, so not there (perf_notes.md, issue 29 item 5).
BIAS_CORRECTED_GROUPS = (64,)
_BIASES = {"qkv_weight": "qkv_bias", "o_weight": "o_bias", "gate_up_weight": "gate_up_bias", "down_weight": "down_bias"}


def activation_importance(model: Any, tokenizer_path: Path | str | None) -> dict[str, torch.Tensor]:
    """Per decoder linear (``layers.{i}.{attr}``), the mean square of each input channel over the calibration
    text, from one forward of the dense model (its weights untouched)."""
    inputs = gptq.calibration_inputs(model, tokenizer_path, keep_inputs=False)
    return {name: c.mean_square for name, c in inputs.items()}


def correct_bias(layer: Any, attr: str, shift: torch.Tensor) -> None:
    """Add ``shift`` (N,) to the bias of ``layer``'s linear ``attr`` (``qkv_weight``, ...), making one (in the
    norms' dtype, where the fused forwards read biases) where the model has none. Bias correction (Nagel et al.
    2019's idea, our code): with ``shift = (W - W_q) @ mean(x)`` over the calibration inputs, the quantized
    linear's mean output there is the dense one's, so a systematic error of the 4-bit grid does not accumulate
    down the residual stream."""
    name = _BIASES[attr]
    if not hasattr(layer, name) or not hasattr(layer, "post_norm"):
        raise TypeError(f"{type(layer).__name__} has no {name} to correct")
    bias = getattr(layer, name)
    dtype = layer.post_norm.weight.dtype
    if bias is None:
        setattr(layer, name, torch.nn.Parameter(shift.to(dtype).contiguous(), requires_grad=False))
    else:
        bias.data.copy_((bias.data.float() + shift).to(bias.dtype))


def weighted_int4(weight: torch.Tensor, group: int, mean_square: torch.Tensor) -> quant.QuantLinear:
    """``weight``'s 4-bit groups searched with each column's squared error weighted by ``mean_square`` (K,), its
    input channel's over the calibration (floored at ``FLOOR`` times the mean)."""
    imp = mean_square.float().clamp_min(FLOOR * float(mean_square.float().mean()))
    return quant.quantize_int4(weight, group, importance=imp, deltas=quant.IMATRIX_STEP_DELTAS)


def quantize_model_imatrix(model: Any, group: int, tokenizer_path: Path | str | None) -> None:
    """Quantize a loaded ``LlamaFamilyModel``'s decoder linears to 4-bit groups of ``group`` with the
    activation-weighted search (candidates ``quant.IMATRIX_STEP_DELTAS``), bias-corrected at the groups in
    ``BIAS_CORRECTED_GROUPS``; the LM head as ``quant.lm_head_format``."""
    inputs = gptq.calibration_inputs(model, tokenizer_path, keep_inputs=False)  # the search needs no X^T X
    shifts: dict[str, torch.Tensor] = {}

    def make(name: str, weight: torch.Tensor) -> quant.QuantLinear | None:
        if name == "lm_head":
            return quant.lm_head_format(weight, f"int4-g{group}")
        c = inputs[name]
        q = weighted_int4(weight, group, c.mean_square)
        if group in BIAS_CORRECTED_GROUPS:
            shifts[name] = (weight.detach().float() - q.dequantize()) @ c.mean
        return q

    model.quantize_linears(make)
    for i, layer in enumerate(model.layers):
        for attr in model.QUANTIZABLE:
            if f"layers.{i}.{attr}" in shifts and hasattr(layer, _BIASES[attr]):
                correct_bias(layer, attr, shifts[f"layers.{i}.{attr}"])
    logger.info(
        "imatrix: the decoder's linears at group %d, weighted by the calibration's activations%s",
        group, ", bias-corrected" if shifts else "",
    )  # fmt: skip
