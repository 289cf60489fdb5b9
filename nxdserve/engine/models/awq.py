"""Activation-aware per-input-channel scaling for the 4-bit groups over 32 (AWQ's idea, Lin et al. 2023; our code).

A linear's output is unchanged when its input channel c is divided by s_c and its weight column c multiplied by
it. Scaling up the columns that large activations multiply gives them more of each group's 16 levels (the group's
grid spans the scaled columns), at the cost of the columns small activations multiply. Per linear group sharing
an input, s_c = ms_c^(alpha / 2), ms_c the mean square of input channel c over the calibration text (the
diagonal ``imatrix.py`` weights its search with; AWQ uses mean |x_c|, the same ordering of channels), with
alpha in ``ALPHAS`` chosen per layer and linear to minimise the linear's output error on the calibration inputs
after quantization, tr(D H D^T) with D the quantized weight's error in the original input space and
H = X^T X the inputs' Gram matrix (``gptq.CalibrationInputs.output_error``). Alpha 0 (s = 1) is the activation-weighted
search alone, so the choice never has more calibration output error than it. The 1/s is folded exactly into
what produces the input:

- q/k/v: the input RMSNorm's weight; gate/up: the post-attention RMSNorm's weight (the norms stay ordinary norm
  weights, so every forward, the fused ones included, runs the scaled model unchanged);
- o: v's output rows (and bias). Attention mixes v's rows per kv head, so one s per v channel, shared by the
  query heads that read it (GQA): o's columns get the s of the v channel they read;
- down: up's output rows (and bias): silu(gate) * up is linear in up.

The embedding, the final norm and the LM head are never touched (tied embeddings stay tied). Layers whose norms
are not plain ``RMSNorm`` keep the imatrix search without scaling. A model that serves LoRA adapters is not
scaled: an adapter's A reads the linear's original input and its B writes the original output
(``quantize_model(..., lora=True)``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from nxdserve.engine.models import gptq, imatrix, quant

logger = logging.getLogger(__name__)

ALPHAS = tuple(a / 10 for a in range(11))  # 0: no scaling
# The groups served scaled. Measured on the default model (a Q4_1 file: 4-bit per 32 already), group 128
# +17.5% -> +13.3% perplexity against the weighted search alone, but group 64 +11.3% -> +11.7..12.7% in three
# variants, so group 64 keeps the weighted search alone (docs/quantization.md, "Accuracy").
SCALED_GROUPS = (128,)
_LINEARS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


def scale_search(
    weight: torch.Tensor,
    inputs: gptq.CalibrationInputs,
    group: int,
    shared: torch.Tensor | None = None,
    alphas: tuple[float, ...] = ALPHAS,
) -> tuple[torch.Tensor, quant.QuantLinear, float]:
    """The per-input-channel scale s (K,), one per exponent in ``alphas``, whose 4-bit codes of ``weight * s``
    (activation-weighted search) give ``weight`` (N, K) the least output error on the calibration ``inputs``; with
    that QuantLinear (of the scaled weight) and its error. ``shared`` (K,) int64: the
    columns with one value there get one s (o's columns reading one v channel), from their mean mean square."""
    w = weight.detach().float()
    mean_square = inputs.mean_square.float().clamp_min(0)
    importance = mean_square.clamp_min(imatrix.FLOOR * float(mean_square.mean()))
    if shared is not None:
        pooled = torch.zeros(int(shared.max()) + 1).index_add_(0, shared, importance)
        pooled /= torch.zeros_like(pooled).index_add_(0, shared, torch.ones_like(importance))
        base = pooled[shared]
    else:
        base = importance

    def quantized(alpha: float) -> tuple[torch.Tensor, quant.QuantLinear, float]:
        s = base.pow(alpha / 2)
        s = s / (s.max() * s.min()).sqrt()  # centred on 1: the folded norm weights keep their magnitude
        q = quant.quantize_int4(w * s, group, importance=importance / s.square(), deltas=quant.IMATRIX_STEP_DELTAS)
        d = q.dequantize() / s - w
        return s, q, inputs.output_error(d)

    # Alpha 0 is the activation-weighted search alone (unrefined): the choice never has more error than it.
    # Refining the chosen grids by least squares measured +13.9% against +13.3% at group 128: not done.
    return min((quantized(alpha) for alpha in alphas), key=lambda f: f[2])


def _scalable(layer: Any) -> bool:
    from nxdserve.engine.models.llama import DecoderLayer, RMSNorm

    return (
        type(layer) is DecoderLayer
        and type(layer.input_norm) is RMSNorm
        and type(layer.post_norm) is RMSNorm
        and all(isinstance(getattr(layer, a), torch.Tensor) for a in _LINEARS)
    )


def _scale_rows(param: torch.Tensor | None, rows: slice, s: torch.Tensor) -> None:
    """Divide ``param``'s ``rows`` (a weight's output rows or a bias's entries) by ``s``, in place."""
    if param is None:
        return
    part = param.data[rows]
    scale = s.to(param.dtype).view(-1, *([1] * (part.dim() - 1)))
    part.copy_((part.float() / scale.float()).to(param.dtype))


def _scale_columns(param: torch.Tensor, s: torch.Tensor) -> None:
    param.data.copy_((param.data.float() * s).to(param.dtype))


def v_channels(spec: Any) -> torch.Tensor:
    """(q_size,) int64: the v channel each of o's input columns reads (column h * head_dim + d reads channel
    (h // heads_per_kv_head) * head_dim + d)."""
    per_kv = spec.num_heads // spec.num_kv_heads
    column = torch.arange(spec.q_size)
    return (column // spec.head_dim // per_kv) * spec.head_dim + column % spec.head_dim


@torch.no_grad()
def fold_scales(
    layer: Any,
    qkv: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    gate_up: torch.Tensor | None = None,
    down: torch.Tensor | None = None,
) -> None:
    """Scale a decoder layer's dense linears' input channels, the inverse folded into their producers, in place:
    ``qkv`` (hidden,) into the input norm; ``v`` (kv_size,) per v channel into v's rows, o's columns times the
    channel's s; ``gate_up`` (hidden,) into the post-attention norm; ``down`` (intermediate,) into up's rows. The
    layer computes the same function (to rounding)."""
    spec = layer.spec
    if v is not None:
        v_rows = slice(spec.q_size + spec.kv_size, spec.q_size + 2 * spec.kv_size)
        _scale_rows(layer.qkv_weight, v_rows, v)
        _scale_rows(layer.qkv_bias, v_rows, v)
        _scale_columns(layer.o_weight, v[v_channels(spec)])
    if down is not None:
        up_rows = slice(spec.intermediate_size, 2 * spec.intermediate_size)
        _scale_rows(layer.gate_up_weight, up_rows, down)
        _scale_rows(layer.gate_up_bias, up_rows, down)
        _scale_columns(layer.down_weight, down)
    for attr, norm, s in (("qkv_weight", layer.input_norm, qkv), ("gate_up_weight", layer.post_norm, gate_up)):
        if s is not None:
            _scale_rows(norm.weight, slice(None), s)
            _scale_columns(getattr(layer, attr), s)


def scale_and_quantize_layer(
    layer: Any,
    inputs: dict[str, gptq.CalibrationInputs],
    prefix: str,
    group: int,
    alphas: tuple[float, ...] = ALPHAS,
) -> dict[str, quant.QuantLinear]:
    """Search and fold the scales of one decoder layer (o and down first: their producers' rows change q/k/v's
    and gate/up's weights, which a per-row grid follows exactly) and return its linears' 4-bit codes by name. Its
    linears' statistics are taken out of ``inputs`` (freed layer by layer)."""
    out: dict[str, quant.QuantLinear] = {}
    columns = v_channels(layer.spec)
    s_o, out["o_weight"], _ = scale_search(layer.o_weight, inputs.pop(f"{prefix}o_weight"), group, columns, alphas)
    fold_scales(layer, v=torch.zeros(layer.spec.kv_size).index_copy_(0, columns, s_o))
    down = inputs.pop(f"{prefix}down_weight")
    s_d, out["down_weight"], _ = scale_search(layer.down_weight, down, group, alphas=alphas)
    fold_scales(layer, down=s_d)
    for attr in ("qkv_weight", "gate_up_weight"):
        s, out[attr], _ = scale_search(getattr(layer, attr), inputs.pop(f"{prefix}{attr}"), group, alphas=alphas)
        fold_scales(layer, **{attr.removesuffix("_weight"): s})
    return out


def quantize_model_awq(model: Any, group: int, tokenizer_path: Path | str | None) -> None:
    """Quantize a loaded ``LlamaFamilyModel``'s decoder linears to 4-bit groups of ``group``: per layer the
    activation-aware scales (folded into the norms and producers as the module doc says) and the
    activation-weighted search; layers that cannot fold get the search alone (imatrix). The LM head: as
    ``quant.lm_head_format`` (Q8_0 blocks on an fp32 model, else dense)."""
    inputs = gptq.calibration_inputs(model, tokenizer_path)
    codes: dict[str, quant.QuantLinear] = {}
    scaled = 0
    for i, layer in enumerate(model.layers):
        if _scalable(layer):
            layer_codes = scale_and_quantize_layer(layer, inputs, f"layers.{i}.", group)
            codes.update({f"layers.{i}.{attr}": q for attr, q in layer_codes.items()})
            scaled += 1

    def make(name: str, weight: torch.Tensor) -> quant.QuantLinear | None:
        if name == "lm_head":
            return quant.lm_head_format(weight, f"int4-g{group}")
        if name in codes:
            return codes[name]
        return imatrix.weighted_int4(weight, group, inputs.pop(name).mean_square)

    model.quantize_linears(make)
    logger.info("awq: 4-bit groups of %d, %d of %d layers activation-scaled", group, scaled, len(model.layers))
