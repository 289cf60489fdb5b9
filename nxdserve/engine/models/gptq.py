"""GPTQ (Frantar et al., 2022) for the online 4-bit groups: error-compensating quantization from calibration
activations, run at load.

Per linear, the inputs X it sees on a shipped calibration text (``data/calibration.txt``: ~1000 tokens of mixed
prose, a recipe, code and Q&A, written for this and disjoint from the perplexity sample) give the Hessian of the
layer's output error, H = X^T X. The columns are then quantized in order; each column's rounding error, divided
by the matching diagonal of H^-1's Cholesky factor, is spread over the columns not yet quantized (in blocks of
``BLOCK`` columns, the later blocks updated by one GEMM per block), so those columns absorb what the rounding lost
as the calibration inputs see it. A group's scale and offset are searched (``quant.int4_group_scales``) on the
updated weights when its first column comes up. The Hessians come from one forward of the dense model over the
calibration text (``calibration_inputs``, shared with ``imatrix.py``; sequential calibration, each layer fed by
the already-quantized ones as llm-compressor's ``GPTQModifier`` runs it, measured no better here). Codes, scales
and offsets land in the same ``QuantLinear`` format as the plain search's: serving is unchanged.

Cost: one prefill of the calibration text, then per linear a Cholesky and a triangular inverse of its (K, K)
Hessian and the column loop (N K^2 multiply-adds; in C, ``csrc/qsearch.c``, where the kernels run). Measured on
the default model, GPTQ lowers each linear's output error on held-out text (0.2-0.8x the plain search's at group 64
with damping 1.0) but raises the model's perplexity (docs/quantization.md, "Accuracy"): it is not offered as a
``--quantization`` method; ``benchmarks/quant_accuracy.py --formats int4-g64-gptq int4-g128-gptq`` reproduces
the figures.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from nxdserve.engine.models import quant
from nxdserve.engine.models.quant import QuantLinear
from nxdserve.errors import ConfigError

logger = logging.getLogger(__name__)

CALIBRATION = Path(__file__).resolve().parent / "data" / "calibration.txt"
CALIBRATION_ROW = 512  # tokens per calibration row (each row one prefill of its own slot)
BLOCK = 128  # columns per lazy-update block (a multiple of every 4-bit group)
DAMP = 0.01  # added to H's diagonal, times its mean (GPTQ's percdamp): keeps H invertible with few tokens


def calibration_ids(tokenizer_path: Path | str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(tokenizer_path))(CALIBRATION.read_text())["input_ids"])


@torch.no_grad()
def gptq_int4(weight: torch.Tensor, hessian: torch.Tensor, group: int) -> QuantLinear:
    """``weight`` (N, K) quantized to 4-bit groups of ``group`` columns by GPTQ against ``hessian`` (K, K) = X^T X
    of the calibration inputs; the ``QuantLinear`` of ``quant.quantize_int4``'s format."""
    if group not in quant.INT4_GROUPS:
        raise ValueError(f"4-bit group size must be one of {quant.INT4_GROUPS}, got {group}")
    w = weight.detach().float().clone()
    k = w.shape[1]
    h = hessian.detach().float().clone()
    dead = h.diagonal() == 0  # inputs never active: their weights cannot matter on the calibration
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h.diagonal().add_(DAMP * float(h.diagonal().mean()))
    upper = inverse_upper_cholesky(h)
    padded = -(-k // group) * group
    if padded != k:  # zero weights on inputs of their own (identity rows of the factor): codes 0, no effect
        w = F.pad(w, (0, padded - k))
        upper = torch.block_diag(upper, torch.eye(padded - k))
    if quant._kernels_on():
        from nxdserve.engine.models.cpu_weight_kernels import gptq_int4 as gptq_in_c

        codes, scales, offsets = gptq_in_c(w, upper, group, [15 + d for d in quant.INT4_STEP_DELTAS])
        return quant.int4_from_codes(codes.to(torch.int32), scales, offsets, group, k)
    codes, scales, offsets = _column_loop(w, upper, group)
    return quant.int4_from_codes(codes, scales, offsets, group, k)


def inverse_upper_cholesky(h: torch.Tensor) -> torch.Tensor:
    """U upper triangular with H^-1 = U^T U, from one Cholesky and one triangular inverse: with P the reversal
    and P H P = L L^T, U = P L^-1 P (half the work of inverting H and factoring the inverse)."""
    lower = torch.linalg.cholesky(h.flip(0, 1))
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    return torch.linalg.solve_triangular(lower, eye, upper=False).flip(0, 1)


def _column_loop(w: torch.Tensor, upper: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """GPTQ's loop in torch (without the C kernels; ``csrc/qsearch.c`` has the same): ``w`` (N, K) is updated in
    place; returns the codes (N, K) int32 and the scales and offsets (N, K / group)."""
    n, k = w.shape
    codes = torch.zeros(n, k, dtype=torch.int32)
    scales = torch.empty(n, k // group)
    offsets = torch.empty(n, k // group)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the loop's ops are small: one thread measured 4-10x faster on a busy host
    try:
        for start in range(0, k, BLOCK):
            end = min(start + BLOCK, k)
            block = w[:, start:end].clone()
            errors = torch.empty_like(block)
            u = upper[start:end, start:end]
            for i in range(end - start):
                col = start + i
                if col % group == 0:  # the group's grid, from the weights as the earlier columns left them
                    s, m = quant.int4_group_scales(block[:, i : i + group].reshape(n, 1, group))
                    scale, offset = s.view(n), m.view(n)
                    scales[:, col // group], offsets[:, col // group] = scale, offset
                column = block[:, i]
                q = quant.int4_codes(column, scale, offset)
                codes[:, col] = q
                err = (column - (q * scale + offset)) / u[i, i]
                block[:, i:].sub_(err[:, None] * u[i, i:][None, :])
                errors[:, i] = err
            w[:, end:].sub_(errors @ upper[start:end, end:])
    finally:
        torch.set_num_threads(threads)
    return codes, scales, offsets


@dataclass(eq=False)
class _Calibrating(QuantLinear):
    """Stands where a linear's weight is during the calibration forward: computes with the dense weight and records
    its inputs' per-channel sums and, with ``keep_inputs``, X^T X in ``CalibrationInputs``' smaller form."""

    dense: torch.Tensor | None = None
    keep_inputs: bool = True
    rows: list[torch.Tensor] = field(default_factory=list)  # X's chunks while no more rows than K
    gram: torch.Tensor | None = None  # X^T X once the rows outnumber K
    input_sum: torch.Tensor | None = None
    square_sum: torch.Tensor | None = None
    tokens: int = 0
    fusable = False  # the forward must call it (a bf16 model's fused forward would read a dense copy instead)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        assert self.dense is not None
        xf = x.reshape(-1, x.shape[-1]).float()
        total, squares = xf.sum(0), xf.square().sum(0)
        self.input_sum = total if self.input_sum is None else self.input_sum + total
        self.square_sum = squares if self.square_sum is None else self.square_sum + squares
        self.tokens += xf.shape[0]
        if self.keep_inputs:
            self._keep(xf)
        out = xf @ self.dense.t()
        out = out.to(x.dtype)
        return out if residual is None else out + residual

    def _keep(self, xf: torch.Tensor) -> None:
        if self.gram is None and self.tokens <= self.in_features:
            self.rows.append(xf.clone())  # the forward reuses its buffers
            return
        if self.gram is None:
            kept = torch.cat(self.rows) if self.rows else xf.new_zeros(0, xf.shape[1])
            self.gram, self.rows = kept.t() @ kept, []
        self.gram += xf.t() @ xf

    def inputs(self) -> CalibrationInputs:
        if self.input_sum is None or self.square_sum is None:
            raise RuntimeError("calibration: a stand-in was not called by the forward")
        rows = torch.cat(self.rows) if self.keep_inputs and self.gram is None else None
        return CalibrationInputs(
            self.input_sum / self.tokens, self.square_sum / self.tokens, self.tokens, gram=self.gram, rows=rows
        )


@dataclass(frozen=True)
class CalibrationInputs:
    """One decoder linear's inputs X (tokens, K) over the calibration text: the mean and mean square of each input
    channel and, where asked for, X^T X in the smaller of two forms: ``rows``, X itself, where there are fewer
    tokens than inputs, else ``gram``, X^T X. So a wide linear's statistics hold min(tokens, K) x K floats, not
    K x K: for a model with 14336-wide MLPs (Llama 3 8B) that is ~0.1 GB a layer against ~1 GB."""

    mean: torch.Tensor  # (K,)
    mean_square: torch.Tensor  # (K,)
    tokens: int
    gram: torch.Tensor | None = None  # X^T X (K, K), tokens >= K
    rows: torch.Tensor | None = None  # X (tokens, K), tokens < K

    def hessian(self) -> torch.Tensor:
        """X^T X (K, K), built on demand from ``rows`` where they are kept."""
        if self.gram is not None:
            return self.gram
        if self.rows is None:
            raise ValueError("these calibration statistics kept no inputs (calibration_inputs(keep_inputs=False))")
        return self.rows.t() @ self.rows

    def output_error(self, delta: torch.Tensor) -> float:
        """tr(D X^T X D^T): the summed squared output error over the calibration inputs of a weight off by
        ``delta`` (N, K)."""
        d = delta.float()
        if self.rows is not None:
            return float((d @ self.rows.t()).square().sum())
        return float(((d @ self.hessian()) * d).sum())


def calibration_inputs(
    model: Any, tokenizer_path: Path | str | None, keep_inputs: bool = True
) -> dict[str, CalibrationInputs]:
    """Per decoder linear (``layers.{i}.{attr}``), its inputs' statistics over ``CALIBRATION`` (tokenized with
    ``tokenizer_path``'s tokenizer), from one forward of the dense model: per-channel mean and mean square, and
    with ``keep_inputs`` what X^T X needs (``CalibrationInputs``). The model's weights are left as they were."""
    from nxdserve.engine.models.runner import SlotModelRunner

    if tokenizer_path is None:
        raise ConfigError("4-bit calibration needs the model's tokenizer for its calibration text.")
    ids = calibration_ids(tokenizer_path)
    row = min(CALIBRATION_ROW, model.max_len)
    rows = [ids[i : i + row] for i in range(0, len(ids), row)]
    rows = [r for r in rows if len(r) >= 16] or rows[:1]
    originals: dict[str, torch.Tensor] = {}
    standins: dict[str, _Calibrating] = {}

    def stand_in(name: str, weight: torch.Tensor) -> QuantLinear | None:
        if name == "lm_head":
            return None
        n, k = weight.shape
        originals[name] = weight
        standins[name] = _Calibrating(
            "int4", n, k, torch.empty(0), torch.empty(0), dense=weight.detach().float(), keep_inputs=keep_inputs
        )
        return standins[name]

    model.quantize_linears(stand_in)
    try:
        runner = SlotModelRunner(model, num_slots=len(rows), max_len=row)
        tokens = torch.tensor([t for r in rows for t in r])
        lens = np.array([len(r) for r in rows])
        with torch.inference_mode():
            runner.run(tokens, np.arange(len(rows)), np.zeros(len(rows), dtype=np.int64), lens)
        del runner
    finally:
        for i, layer in enumerate(model.layers):
            for attr in model.QUANTIZABLE:
                setattr(layer, attr, originals[f"layers.{i}.{attr}"])
    return {name: standin.inputs() for name, standin in standins.items()}


def quantize_model_gptq(model: Any, group: int, tokenizer_path: Path | str | None) -> None:
    """Quantize a loaded ``LlamaFamilyModel``'s decoder linears to 4-bit groups of ``group`` with GPTQ, the
    Hessians from one forward of the dense model over the calibration text; the LM head stays dense."""
    inputs = calibration_inputs(model, tokenizer_path)
    model.quantize_linears(
        lambda name, weight: None if name == "lm_head" else gptq_int4(weight, inputs.pop(name).hessian(), group)
    )
    logger.info("GPTQ: the decoder's linears at group %d", group)
