"""Activation-weighted 4-bit groups (llama.cpp's "imatrix", the importance weighting AWQ also builds on): the scale
search of ``quant.quantize_int4`` with each weight's squared error weighted by the mean square of its input
channel on a calibration text, so the grid fits the weights that large activations multiply.

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


def activation_importance(model: Any, tokenizer_path: Path | str | None) -> dict[str, torch.Tensor]:
    """Per decoder linear (``layers.{i}.{attr}``), the mean square of each input channel over the calibration
    text, from one forward of the dense model (its weights untouched)."""
    hessians = gptq.calibration_hessians(model, tokenizer_path)
    return {name: h.diagonal() / tokens for name, (h, tokens) in hessians.items()}


def weighted_int4(weight: torch.Tensor, group: int, mean_square: torch.Tensor) -> quant.QuantLinear:
    """``weight``'s 4-bit groups searched with each column's squared error weighted by ``mean_square`` (K,), its
    input channel's over the calibration (floored at ``FLOOR`` times the mean)."""
    imp = mean_square.float().clamp_min(FLOOR * float(mean_square.float().mean()))
    return quant.quantize_int4(weight, group, importance=imp, deltas=quant.IMATRIX_STEP_DELTAS)


def quantize_model_imatrix(model: Any, group: int, tokenizer_path: Path | str | None) -> None:
    """Quantize a loaded ``LlamaFamilyModel``'s decoder linears to 4-bit groups of ``group`` with the
    activation-weighted search (candidates ``quant.IMATRIX_STEP_DELTAS``); the LM head stays dense."""
    importance = activation_importance(model, tokenizer_path)

    def make(name: str, weight: torch.Tensor) -> quant.QuantLinear | None:
        return None if name == "lm_head" else weighted_int4(weight, group, importance[name])

    model.quantize_linears(make)
    logger.info("imatrix: the decoder's linears at group %d, weighted by the calibration's activations", group)
