"""End-to-end tuning of 4-bit group scales and offsets (EfficientQAT's "E2E-QP" idea, our code).

After the calibrated search (``awq.py`` / ``imatrix.py``) has chosen every decoder linear's codes, the codes stay
fixed and each group's scale and offset are trained by Adam to minimise the KL divergence of the quantized model's
next-token distributions from the dense model's over the tuning texts. A weight is ``code * scale + offset``,
linear in both, so the gradient is exact (no straight-through estimator). Every criterion the search tried before
was per linear or per block, and on the default model a linear's output error did not follow perplexity; the
whole model's KL did (docs/quantization.md, issue 29 item 5).

The teacher is the dense model, read once before quantization: per position its top ``TOP_K`` log-probabilities
and the mass of the rest, so neither the dense weights nor a vocabulary-wide distribution per token stays in
memory. The loss is the KL between the two distributions collapsed onto those classes plus "the rest" (a lower
bound of the full KL, equal when the rest is one class).

Cost: per epoch about three fp32 forwards of the model over the tuning texts' ~8000 tokens (the default model on
a 2-core CPU: ~80 s an epoch), two fp32 copies of the decoder linears while it trains (the codes as floats, each
step's weights), 2 parameters per group. Hours and tens of GB for a 7-8B model on a CPU, hence
``--quantization-tune-epochs`` (0: untuned). Measured: docs/quantization.md ("End-to-end tuning").
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nxdserve.engine.models import gptq
from nxdserve.engine.models.quant import QuantLinear
from nxdserve.engine.models.rope import apply_rope

logger = logging.getLogger(__name__)

# Groups whose scales are tuned (quant.quantize_model): 128 (+14.47% -> +8.06% perplexity on the default model).
# Not 64: within 10% already (+9.58%) and loaded in seconds.
TUNED_GROUPS = (128,)
# The calibration text, then ~7000 tokens the dense default model wrote itself at temperature 0.8 answering 32
# prompts of the EAGLE prompt set (LLM-QAT's data-free idea). Distillation is a distribution match, so text the
# model itself finds likely is a fair sample of it; the activation statistics stay on the calibration text alone
# (with the generated text awq.py's scales got worse).
GENERATED = Path(__file__).resolve().parent / "data" / "calibration_generated.txt"
TUNING_TEXTS = (gptq.CALIBRATION, GENERATED)
CHUNK = 256  # tokens a row: each row starts at position 0, as the calibration's do
TOP_K = 64
LEARNING_RATE = 3e-5  # absolute, decayed linearly to 0 over the run (measured: docs/quantization.md)
EPOCHS = 3

_LINEARS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


@dataclass
class Targets:
    """The dense model's next-token distributions over the tuning rows, top ``TOP_K`` classes of each position."""

    rows: list[torch.Tensor]  # token ids (T,) per row
    logprobs: list[torch.Tensor]  # (T, k) fp32
    indices: list[torch.Tensor]  # (T, k) int64

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.rows)


def tuning_rows(tokenizer_path: Path | str, chunk: int = CHUNK) -> list[torch.Tensor]:
    """The tuning texts tokenized, each cut into rows of ``chunk`` tokens (a shorter last row kept if > 16)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    rows = []
    for text in TUNING_TEXTS:
        ids = tokenizer(text.read_text())["input_ids"]
        rows += [torch.tensor(ids[i : i + chunk]) for i in range(0, len(ids), chunk) if len(ids[i : i + chunk]) > 16]
    return rows


class _Frozen:
    """The model's parameters the forward reads but does not train, as fp32 copies made outside inference mode
    (a loaded model's tensors may be inference tensors, which autograd cannot save)."""

    def __init__(self, model: Any) -> None:
        with torch.inference_mode(False):
            self.embed = model.embed_weight.detach().float().clone()
            head = model.lm_head_quant.dequantize() if model.lm_head_quant is not None else model.lm_head_weight
            self.head = head.detach().float().clone()
            self.norm = model.norm.weight.detach().float().clone()
            self.layers = [{name: t.detach().float().clone() for name, t in _layer_tensors(layer).items()}
                           for layer in model.layers]  # fmt: skip
            self.eps = model.norm.eps
            rope = model.rope
            self.cos, self.sin = rope.cos.detach().float().clone(), rope.sin.detach().float().clone()


def _layer_tensors(layer: Any) -> dict[str, torch.Tensor]:
    out = {"input_norm": layer.input_norm.weight, "post_norm": layer.post_norm.weight}
    for name in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias"):
        if getattr(layer, name, None) is not None:
            out[name] = getattr(layer, name)
    if layer.q_norm is not None:
        out["q_norm"], out["k_norm"] = layer.q_norm.weight, layer.k_norm.weight
    return out


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_logits(
    model: Any, frozen: _Frozen, ids: torch.Tensor, weights: list[dict[str, torch.Tensor]]
) -> torch.Tensor:
    """(T, vocab) fp32 logits of one row from position 0, with the decoder linears ``weights[i][attr]`` (dense
    (N, K) tensors, differentiable): the model's forward (``LlamaFamilyModel``, full causal or sliding-window
    attention, GQA, q/k norms, biases) in fp32 without a KV cache."""
    s = model.spec
    t = len(ids)
    positions = torch.arange(t)
    cos, sin = frozen.cos[positions].unsqueeze(1), frozen.sin[positions].unsqueeze(1)
    x = frozen.embed[ids]
    for layer, own, w in zip(model.layers, frozen.layers, weights, strict=True):
        h = _rms(x, own["input_norm"], frozen.eps)
        qkv = h @ w["qkv_weight"].T
        if "qkv_bias" in own:
            qkv = qkv + own["qkv_bias"]
        q = qkv[:, : s.q_size].view(t, s.num_heads, s.head_dim)
        k = qkv[:, s.q_size : s.q_size + s.kv_size].view(t, s.num_kv_heads, s.head_dim)
        v = qkv[:, s.q_size + s.kv_size :].view(t, s.num_kv_heads, s.head_dim)
        if "q_norm" in own:
            q, k = _rms(q, own["q_norm"], frozen.eps), _rms(k, own["k_norm"], frozen.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeat = s.num_heads // s.num_kv_heads
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        allowed = positions[:, None] >= positions[None, :]
        if layer.window is not None:
            allowed &= positions[:, None] - positions[None, :] < layer.window
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(0, 1).reshape(t, s.q_size)
        x = x + attn @ w["o_weight"].T + own.get("o_bias", 0.0)
        h = _rms(x, own["post_norm"], frozen.eps)
        gate_up = h @ w["gate_up_weight"].T
        if "gate_up_bias" in own:
            gate_up = gate_up + own["gate_up_bias"]
        gate, up = gate_up.chunk(2, dim=-1)
        x = x + (layer.act(gate) * up) @ w["down_weight"].T + own.get("down_bias", 0.0)
    return _rms(x, frozen.norm, frozen.eps) @ frozen.head.T


@torch.no_grad()
def teacher_targets(model: Any, tokenizer_path: Path | str, top_k: int | None = None) -> Targets:
    """The dense ``model``'s targets over the tuning rows (read before its linears are quantized), its top
    ``top_k`` (default ``TOP_K``) classes a position."""
    top_k = TOP_K if top_k is None else top_k
    frozen = _Frozen(model)
    with torch.inference_mode(False):
        weights = [{attr: getattr(layer, attr).detach().float() for attr in _LINEARS} for layer in model.layers]
        targets = Targets([], [], [])
        for row in tuning_rows(tokenizer_path, min(CHUNK, model.max_len)):
            top = torch.log_softmax(reference_logits(model, frozen, row, weights), dim=-1).topk(top_k, dim=-1)
            targets.rows.append(row)
            targets.logprobs.append(top.values)
            targets.indices.append(top.indices)
    return targets


def collapsed_kl(logits: torch.Tensor, logprobs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Sum over positions of KL(teacher || student), both collapsed onto the teacher's top classes ``indices``
    plus one class for the rest of the vocabulary."""
    student = torch.log_softmax(logits, dim=-1)
    student_top = student.gather(1, indices)
    p_top = logprobs.exp()
    kl = (p_top * (logprobs - student_top)).sum(-1)
    rest_p = (1 - p_top.sum(-1)).clamp_min(1e-12)
    rest_q = (1 - student_top.exp().sum(-1)).clamp_min(1e-12)
    return (kl + rest_p * (rest_p.log() - rest_q.log())).sum()


class _Groups:
    """One 4-bit linear's codes (fixed) and its per-group scale and offset (trained)."""

    def __init__(self, linear: QuantLinear) -> None:
        self.linear = linear
        g = linear.group
        step = g // 32  # the stored per-32 scales repeat each group's
        codes = linear.codes().float()
        self.codes = F.pad(codes, (0, -(-codes.shape[1] // g) * g - codes.shape[1]))
        assert linear.offsets is not None
        self.scale = linear.scales[:, ::step].clone().requires_grad_(True)
        self.offset = linear.offsets[:, ::step].clone().requires_grad_(True)

    def weight(self) -> torch.Tensor:
        n, padded = self.codes.shape
        g = self.linear.group
        w = self.codes.view(n, padded // g, g) * self.scale[..., None] + self.offset[..., None]
        return w.view(n, padded)[:, : self.linear.in_features]

    @torch.no_grad()
    def write_back(self) -> None:
        lin = self.linear
        step = lin.group // 32
        kept = lin.scales.shape[1]
        lin.scales.copy_(self.scale.detach().repeat_interleave(step, dim=1)[:, :kept])
        assert lin.offsets is not None
        lin.offsets.copy_(self.offset.detach().repeat_interleave(step, dim=1)[:, :kept])
        lin.__dict__.pop("_cache", None)  # copies expanded from the old scales


def supports(model: Any) -> bool:
    """Whether ``reference_logits`` is ``model``'s forward: a plain ``LlamaFamilyModel`` of ``DecoderLayer``s (a
    Qwen2-VL text model is one: on text its M-RoPE is the 1-D RoPE), not Mllama's decoder, whose cross-attention
    layers it does not model."""
    from nxdserve.engine.models.llama import DecoderLayer, LlamaFamilyModel

    return type(model) is LlamaFamilyModel and all(type(layer) is DecoderLayer for layer in model.layers)


def tunable(model: Any) -> bool:
    """Whether every decoder linear is a 4-bit ``QuantLinear`` with offsets (what ``tune_scales`` trains)."""
    return all(
        isinstance(q := getattr(layer, attr), QuantLinear) and q.kind == "int4" and q.offsets is not None
        for layer in model.layers
        for attr in _LINEARS
    )


def tune_scales(
    model: Any, targets: Targets, epochs: int | None = None, lr: float | None = None
) -> tuple[float, float]:
    """Train the 4-bit decoder linears' group scales and offsets of ``model`` against ``targets`` (Adam from
    ``lr``, default ``LEARNING_RATE``, decayed linearly to 0 over ``epochs``, default ``EPOCHS``), write them
    back, and return the mean collapsed KL a token over the first and over the last epoch."""
    epochs = EPOCHS if epochs is None else epochs
    lr = LEARNING_RATE if lr is None else lr
    if not tunable(model):
        raise TypeError("tune_scales: every decoder linear must be 4-bit with offsets")
    weights = sum(getattr(layer, attr).out_features * getattr(layer, attr).in_features
                  for layer in model.layers for attr in _LINEARS)  # fmt: skip
    logger.info(
        "qtune: tuning the 4-bit group scales, %d epochs over %d tokens: ~%.0f TFLOP in fp32 "
        "(--quantization-tune-epochs 0 skips it)",
        epochs, targets.tokens, 6 * weights * targets.tokens * epochs / 1e12,
    )  # fmt: skip
    start = time.perf_counter()
    with torch.inference_mode(False), torch.enable_grad():
        frozen = _Frozen(model)
        groups = [{attr: _Groups(getattr(layer, attr)) for attr in _LINEARS} for layer in model.layers]
        params = [p for layer in groups for g in layer.values() for p in (g.scale, g.offset)]
        opt = torch.optim.Adam(params, lr=lr)
        steps = max(1, epochs * len(targets.rows))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps)
        losses: list[float] = []
        for _ in range(epochs):
            total = 0.0
            for row, logprobs, indices in zip(targets.rows, targets.logprobs, targets.indices, strict=True):
                opt.zero_grad()
                weights = [{attr: g.weight() for attr, g in layer.items()} for layer in groups]
                loss = collapsed_kl(reference_logits(model, frozen, row, weights), logprobs, indices)
                (loss / len(row)).backward()
                opt.step()
                sched.step()
                total += float(loss.detach())
            losses.append(total / targets.tokens)
        for layer in groups:
            for g in layer.values():
                g.write_back()
    first, last = (losses[0], losses[-1]) if losses else (math.nan, math.nan)
    logger.info(
        "qtune: %d rows, %d tokens, %d epochs in %.1f s; KL a token %.4f (first epoch) -> %.4f (last)",
        len(targets.rows), targets.tokens, epochs, time.perf_counter() - start, first, last,
    )  # fmt: skip
    return first, last
