"""Weight-only quantized linears: int8 per output channel, 4-bit group-wise, fp8 e4m3 per 32 columns (or row).

A ``QuantLinear`` stands where a layer's dense weight stood (``linear.linear`` calls it). It keeps the codes
as our C kernel reads them (``csrc/qgemm.c``, ``cpu_weight_kernels.QgemmWeight``): 4-bit codes two a byte in GGUF's
nibble order with an fp32 scale and offset per 32 input columns (``w = q * scale + offset``: our min/max codes,
and exactly GGUF's Q4_0 ``d * (q - 8)``, Q4_1 ``d * q + m`` and Q4_K sub-blocks, ``gguf_weights.py``), int8
codes with a scale per row or per group (GGUF's Q8_0), fp8 e4m3 codes with a scale per row or per 32 columns.
Per call the rows decide (``dense_rows``, ``CpuOptions.quant_dense_rows``, measured in ``benchmarks/quant_bench.py``):

- a few rows (decode: bound by the weight's bytes): the C kernel, fp32 activations, the codes widened in
  registers: the dense fp32 expansion's results to fp32 rounding;
- fp32 activations, more rows (bound by FLOPs): up to ``kernel_rows()`` rows the kernel's paired rows (each weight
  row widened once per call into a thread's buffer, then two rows against many rows of x); a prefill chunk above
  that a transient fp32 copy (``QgemmWeight.to_f32``) and the dense GEMM. Nothing is kept: the weights' memory
  is the codes'.
- bf16 activations (a bf16 model, whose fused AVX512-BF16 / AMX forward reads the same copy), more rows: a dense
  bf16 copy expanded once from the codes and kept (codes + 2 bytes a weight).

Without the C kernels (``--cpu-isa none``, no compiler) PyTorch's own weight-only ops run: int8
``aten._weight_int8pack_mm``; 4-bit ``aten._weight_int4pack_mm_for_cpu`` (its layout made from the codes on first
use; its dequantization ``(q - 8) * scale + zero`` takes ``zero = offset + 8 * scale``); fp8 and grouped int8
through a dense copy (widening fp8 per call in torch measured 13-40x slower than a dense GEMM). On AVX2 PyTorch's
int8/int4 kernels are vectorised for bf16 activations and not for fp32 (fp32 activations 5-9x slower than a dense
fp32 GEMM at one row), so they get the activations in bf16 (``kernel_dtype``) and the output is cast back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nxdserve.errors import ConfigError

logger = logging.getLogger(__name__)

INT4_GROUPS = (32, 64, 128)
KERNEL_DTYPE = torch.bfloat16  # the activations PyTorch's weight-only kernels get (see the module doc)
# None: the kernels get the model's own activations (fp32 models then compute the blocks exactly in fp32:
# the reference the tests compare against; slower on AVX2).
kernel_dtype: torch.dtype | None = KERNEL_DTYPE
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
# Calls of up to this many rows run the C kernel on the codes; more rows a dense copy (0: the kernel always).
# Set from CpuOptions.quant_dense_rows; the default is the measured crossover (perf_notes.md).
DENSE_ROWS = 16
dense_rows = DENSE_ROWS
# The small-row kernel rounds the activations to int8 per 32-block and takes integer dot products (q4 and int8
# codes; csrc/qgemm_i8.c). Off by default: it changes results. Set from CpuOptions.quant_int8_activations.
int8_activations = False
# Calls in fp32 (and bf16 weights' calls) of up to kernel_rows() rows run the kernel (paired rows above a few), more
# a transient fp32 copy and the dense GEMM. The build says how many (csrc/qgemm.c, Q_PAIR_MAX): 64 in the AVX2 build
# since its paired rows hold their loads in registers (perf_notes.md, "Loads held in registers"), KERNEL_ROWS in the
# others, as measured before that (perf_notes.md, "bf16 weights", "paired rows": the bf16 kernel 0.9-1.17x sgemm's
# time at 32 rows, 1.2-1.6x at 64, where widening per call costs ~1.15x).
KERNEL_ROWS = 32


@dataclass(eq=False)
class QuantLinear:
    """A quantized (out_features, in_features) weight and the call that multiplies by it.

    Per call the rows decide (``dense_rows``): up to that many rows go to the C kernel
    (``cpu_weight_kernels.QgemmWeight``, fp32 activations, reading the codes as stored); more rows to a dense copy
    expanded once from the codes in the activations' dtype (a batched step is bound by FLOPs, where a dense GEMM
    wins). Without the C kernels (``--cpu-isa none``, no compiler) PyTorch's weight-only ops take the small calls
    instead, and the same rule sends the larger ones to the dense copy."""

    # "int8" | "int4" | "fp8" | "q8_0" (int8 with a scale per group of ``group``: gguf_weights.py) | "bf16" (the
    # weight itself in bfloat16, computed in fp32: ``store_bf16``)
    kind: str
    out_features: int
    in_features: int
    # int8 (N, K) | int4: uint8 (N, K_padded / 2), per 32 columns 16 bytes in GGUF's order (low nibbles are the
    # first 16 codes, high nibbles the next 16) | float8_e4m3fn (N, K) | q8_0: int8 (N, K) | bfloat16 (N, K)
    data: torch.Tensor
    # fp32: (N,) for int8 and per-row fp8; (N, K_padded / 32) for int4; (N, K / group) for q8_0 and block fp8;
    # empty for bf16
    scales: torch.Tensor
    # int4: the group the scales were computed over (they are stored per 32); q8_0: its group; fp8: 0 = one scale
    # per row, else one per ``group`` input columns
    group: int = 0
    padded_in: int = 0  # int4: K rounded up to a multiple of 32 (zero codes beyond in_features)
    offsets: torch.Tensor | None = None  # int4: (N, K_padded / 32) fp32; w = code * scale + offset
    # Whether a fused forward may read this weight's dense copy in place of calling it (a calibration stand-in,
    # which records its inputs when called, may not)
    fusable = True

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        """The bytes of the codes and scales (what a small-row call reads), not of the caches made from them."""
        parts = [self.data, self.scales] + ([] if self.offsets is None else [self.offsets])
        return sum(t.numel() * t.element_size() for t in parts)

    def _cached(self, key: Any, make: Callable[[], Any]) -> Any:
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T`` (+ ``residual``, rounded as the eager ``out + residual``) for x (M, K) in fp32 or bf16."""
        kernel, on_rows = self._route(x)
        if kernel is not None:
            if on_rows:
                return self._kernel_call(x, kernel, residual)
            return self._widened_call(x, kernel, residual)
        out = self._torch_call(x)
        return out if residual is None else out + residual

    def greedy(self, x: torch.Tensor, cols: int) -> torch.Tensor | None:
        """(M,) ``self(x)[:, :cols].argmax(-1)``, the same indices, for fp32 ``x`` whose call runs on the row kernel
        (``QgemmWeight.argmax``: a greedy LM head that never reads its logits back); None elsewhere."""
        kernel, on_rows = self._route(x)
        if kernel is None or not on_rows or x.dtype != torch.float32:
            return None
        return kernel.argmax(self._kernel_input(x, kernel), cols, int8_activations)

    def _route(self, x: torch.Tensor) -> tuple[Any, bool]:
        """The kernel a call on ``x`` takes (None: PyTorch's ops), and whether its rows run on it (``_kernel_call``)
        or on a widened copy of the weight (``_widened_call``)."""
        rows = x.shape[0]
        small = not dense_rows or rows <= dense_rows
        widened = x.dtype == torch.float32 or self.kind == "bf16"  # calls that never keep a dense copy
        kernel = self._kernel_args() if (small or widened) and _kernels_take(x) else None
        return kernel, kernel is not None and (small or rows <= kernel_rows())

    def _widened_call(self, x: torch.Tensor, kernel: Any, residual: torch.Tensor | None) -> torch.Tensor:
        """A call of many rows (a prefill chunk, where the dense GEMM's speed pays for widening the weight once per
        call): a transient fp32 copy, never kept, so that the weights' memory stays the codes'."""
        from nxdserve.engine.models.linear import linear

        wide = kernel.to_f32()
        xw = x if kernel.in_features == self.in_features else F.pad(x, (0, kernel.in_features - self.in_features))
        out = linear(xw, wide if x.dtype == torch.float32 else wide.to(x.dtype))
        return out if residual is None else out + residual

    def _kernel_args(self) -> Any:
        """The ``cpu_weight_kernels.QgemmWeight`` of these codes, made once; None where no kernel format fits (q8_0
        groups that are not multiples of 32)."""
        return self._cached("kernel", self._make_kernel_args)

    def _make_kernel_args(self) -> Any:
        from nxdserve.engine.models.cpu_weight_kernels import QgemmWeight

        args = self._kernel_layout()
        return None if args is None else QgemmWeight(*args)

    def _kernel_layout(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, str] | None:
        block = 32
        if self.kind == "int4":
            return self.data, self.scales, self.offsets, "q4"
        if self.kind in ("q8_0", "fp8") and self.group % block:
            return None
        padded = -(-self.in_features // block) * block
        if self.kind == "bf16":  # the weight itself where K needs no padding: a padded copy would hold it twice
            data = self.data if padded == self.in_features else F.pad(self.data, (0, padded - self.in_features))
            return data.contiguous(), None, None, "bf16"
        codes = self.data.view(torch.uint8)  # zero bytes beyond K: zero codes in every format
        if padded != self.in_features:
            codes = F.pad(codes, (0, padded - self.in_features))
        if self.group == 0:  # int8 and per-row fp8: the row's scale for each of its blocks
            scales = self.scales.float()[:, None].expand(-1, padded // block)
        else:  # q8_0 and block fp8: each group's scale for each of its blocks
            scales = self.scales.float().repeat_interleave(self.group // block, dim=1)
        if self.kind == "fp8":
            return codes.contiguous(), scales.contiguous(), None, "fp8"
        return codes.view(torch.int8).contiguous(), scales.contiguous(), None, "q8"

    def _kernel_input(self, x: torch.Tensor, kernel: Any) -> torch.Tensor:
        xf = x if x.dtype == torch.float32 else x.float()
        if kernel.in_features != self.in_features:  # zero activations against the padding's zero codes
            return F.pad(xf, (0, kernel.in_features - self.in_features))
        return xf if xf.stride(-1) == 1 else xf.contiguous()

    def _kernel_call(self, x: torch.Tensor, kernel: Any, residual: torch.Tensor | None) -> torch.Tensor:
        xf = self._kernel_input(x, kernel)
        fused = residual is not None and residual.dtype == torch.float32 and residual.stride(-1) == 1
        out = kernel(xf, residual if fused else None, int8_activations)
        out = out if x.dtype == torch.float32 else out.to(x.dtype)
        return out if residual is None or fused else out + residual

    def _torch_call(self, x: torch.Tensor) -> torch.Tensor:
        """A dense copy for calls above ``dense_rows`` rows (and every call of a format PyTorch has no op for);
        without the kernels PyTorch's weight-only ops for the smaller ones. Measured without kernels (AVX2,
        perf_notes.md): int4pack at 16-32 rows within 7% of the dense fp32 GEMM's time, 1.4x it at 64, and at 32
        concurrent the engine served 0.90x dense fp32 with int4pack (its bf16 casts) for every call."""
        from nxdserve.engine.models.linear import linear

        if self.kind == "bf16":  # keeping a wider copy would undo the format's point
            return linear(x, self.data.to(x.dtype))
        large = bool(dense_rows) and x.shape[0] > dense_rows and x.device.type == "cpu"
        if large or _kernels_on() or self.kind in ("fp8", "q8_0"):
            return linear(x, self.dense_copy(x.dtype))
        act = kernel_dtype or x.dtype
        xb = x.to(act).contiguous()
        if self.kind == "int8":
            scales = self._cached(("scales", act), lambda: self.scales.to(act).contiguous())
            # K padded to a multiple of 16 with zero codes: PyTorch 2.13's AVX512 bf16 kernel of this op reads
            # past a K that is not one and crashed the process (SIGSEGV on a Xeon with AMX, 3+ rows).
            codes, pad = self.data, -self.in_features % 16
            if pad:
                xb = F.pad(xb, (0, pad))
                codes = self._cached("int8pad", lambda: F.pad(self.data, (0, pad)).contiguous())
            out = torch.ops.aten._weight_int8pack_mm(xb, codes, scales)
        else:
            padded = -(-self.in_features // self.group) * self.group
            if padded != self.in_features:
                xb = F.pad(xb, (0, padded - self.in_features))
            packed, scales_and_zeros = self._cached("int4pack", self._int4pack)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, self.group, scales_and_zeros.to(act))
            if out.shape[1] != self.out_features:  # rows padded to the layout's multiple of 16
                out = out[:, : self.out_features].contiguous()
        return out.to(x.dtype)

    def dense_copy(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense copy that calls above ``dense_rows`` rows multiply by, expanded once per dtype and kept (the
        fused bf16 forward reads it for such steps too: fused_decode.py). Made outside inference mode, so that the
        packed GEMM copies kept on it (gemm.kept) can key on its version counter, which inference tensors lack."""

        def make() -> torch.Tensor:
            with torch.inference_mode(False):
                return self.dequantize(dtype)

        return self._cached(("dense", dtype), make)

    def codes(self) -> torch.Tensor:
        """int4: the codes (N, K_padded) as int32 in 0..15."""
        n = self.out_features
        blocks = self.data.view(n, -1, 16)
        return torch.cat((blocks & 0x0F, blocks >> 4), dim=2).view(n, self.padded_in).to(torch.int32)

    def _int4pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """PyTorch's int4 layout of these codes, whose dequantization is ``(q - 8) * scale + zero`` per group:
        an asymmetric ``q * scale + offset`` maps onto it with ``zero = offset + 8 * scale``."""
        assert self.offsets is not None
        n = self.out_features
        rows = -n // 16 * -16  # the packed layout takes N in multiples of 16: zero rows, sliced off after the call
        step = self.group // 32  # the stored per-32 scales repeat each group's
        scale, offset = self.scales[:, ::step], self.offsets[:, ::step]
        padded = -(-self.in_features // self.group) * self.group  # the layout's K: whole groups
        codes = F.pad(self.codes(), (0, padded - self.padded_in, 0, rows - n))
        scale, offset = (F.pad(t, (0, 0, 0, rows - n)) for t in (scale, offset))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        zero = offset + 8.0 * scale
        return packed, torch.stack((scale.t(), zero.t()), dim=-1).contiguous()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense (N, K) weight these codes stand for, computed in fp32."""
        if self.kind == "bf16":
            return self.data.to(dtype)
        if self.kind == "int8":
            return (self.data.float() * self.scales[:, None]).to(dtype)
        if self.kind == "fp8" and not self.group:
            return (self.data.float() * self.scales[:, None]).to(dtype)
        if self.kind in ("q8_0", "fp8"):
            n, k = self.data.shape
            blocks = self.data.float().view(n, k // self.group, self.group) * self.scales[..., None]
            return blocks.view(n, k).to(dtype)
        assert self.offsets is not None
        n = self.out_features
        blocks = self.codes().float().view(n, -1, 32) * self.scales[..., None] + self.offsets[..., None]
        return blocks.view(n, self.padded_in)[:, : self.in_features].contiguous().to(dtype)


# Makes the quantized weight of a linear (``layers.{i}.{attr}`` or ``lm_head``) from its dense weight; None keeps
# it dense (``LlamaFamilyModel.quantize_linears``).
LinearMaker = Callable[[str, torch.Tensor], "QuantLinear | None"]


def _kernels_on() -> bool:
    from nxdserve.engine.models import cpu_kernels

    return cpu_kernels.available()


def kernel_rows() -> int:
    """The most rows of an fp32 call the running kernel build takes on its paired rows; 0 where it has none (the
    portable C build: there a call of more than ``dense_rows`` rows is faster on a transient widened copy than on
    the row kernel)."""
    from nxdserve.engine.models import cpu_kernels

    return cpu_kernels.built_value("qgemm_paired_max_rows")


def int8_activation_rows() -> int:
    """With ``int8_activations``, calls of fewer rows than this run on int8 activations and larger ones on the fp32
    kernels (faster there: perf_notes.md); 0: every call (the AVX512 build, where int8 stays faster, and the builds
    where that is unmeasured)."""
    from nxdserve.engine.models import cpu_kernels

    return cpu_kernels.built_value("qgemm_i8_max_rows")


def _kernels_take(x: torch.Tensor) -> bool:
    """Whether the C kernels can take a call on ``x``: CPU, fp32 or bf16, no autograd, the kernels built."""
    if x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return False
    return x.dtype in (torch.float32, torch.bfloat16) and _kernels_on()


def quantize_int8(weight: torch.Tensor) -> QuantLinear:
    """Symmetric int8, one scale per output row (absmax / 127)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantLinear("int8", w.shape[0], w.shape[1], q.contiguous(), scale)


FP8_BLOCK = 32  # fp8 scales: one per this many input columns of a row
# Candidate scales per fp8 block: absmax / 448 times 2**(j / 16), j < 16. e4m3's grid is log-spaced (3 mantissa
# bits), so one octave of scales covers every placement of a block's values on it; the largest value never clips.
FP8_SCALE_STEPS = 16
FP8_SCALE_MULTIPLIERS = tuple(2.0 ** (step / FP8_SCALE_STEPS) for step in range(FP8_SCALE_STEPS))
# Candidate 4-bit steps per group: (max - min) / (15 + d), d in this grid (llama.cpp's make_qkx2_quants searches
# the same span); each candidate's codes then get the least-squares scale and offset.
INT4_STEP_DELTAS = tuple(d / 5 for d in range(-5, 6))
# The activation-weighted search (imatrix.py) over twice the span: d in -2..2 measured 13.0% -> 11.3% perplexity at
# group 64 on the default model (a finer -3..3 grid in steps of 0.1: the same 11.2%).
IMATRIX_STEP_DELTAS = tuple(d / 5 for d in range(-10, 11))
# 4-bit groups over 32 calibrate at load (imatrix.py): the plain search measured +20% / +70% perplexity at 64 / 128
# on the default model, the activation-weighted one +11% / +18%, with awq.py's input scales at 128 +13%
# (docs/quantization.md, "Accuracy").
CALIBRATED_GROUPS = (64, 128)
# True: ``--quantization fp8`` makes NxD's own codes (per_channel_symmetric: one absmax scale per row, no search),
# for comparing the torch backend with the nxd one weight for weight (tests).
fp8_per_channel_absmax = False


def quantize_fp8(weight: torch.Tensor, block: int = FP8_BLOCK, search: bool = True) -> QuantLinear:
    """fp8 e4m3 with one scale per ``block`` input columns of each row (per row where ``block`` is 0 or does not
    divide K), each scale the candidate (``FP8_SCALE_STEPS``) whose codes have the least squared error
    (``search``; else absmax / 448).

    On the default model per-row absmax scales cost 1.9% perplexity, over the issue's 1% bound; 32-column blocks
    with the search measured within it (docs/quantization.md, "Accuracy")."""
    w = weight.detach().float()
    n, k = w.shape
    group = block if block and k % block == 0 else k
    blocks = w.view(n, k // group, group)
    if search and _kernels_on():
        from nxdserve.engine.models.cpu_weight_kernels import quant_search

        best_scale = quant_search(w, group, FP8_SCALE_MULTIPLIERS, "fp8")[0].unsqueeze(2)
    else:
        best_scale = _fp8_search(blocks, FP8_SCALE_STEPS if search else 1)
    codes = (blocks / best_scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(n, k)
    scales = best_scale.view(n, k // group)
    if group == k:
        return QuantLinear("fp8", n, k, codes.contiguous(), scales.view(n).contiguous())
    return QuantLinear("fp8", n, k, codes.contiguous(), scales.contiguous(), group=group)


def _fp8_search(blocks: torch.Tensor, steps: int) -> torch.Tensor:
    """The least-squared-error scale per block of ``blocks`` (rows, blocks, size) among the first ``steps`` of
    ``FP8_SCALE_MULTIPLIERS`` times absmax / 448 (torch; ``csrc/qsearch.c`` makes the same choice in C)."""
    base = (blocks.abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    best_err = torch.full_like(base, float("inf"))
    best_scale = base
    for multiplier in FP8_SCALE_MULTIPLIERS[:steps]:
        scale = base * multiplier
        err = ((blocks / scale).to(torch.float8_e4m3fn).float() * scale - blocks).square_().sum(dim=2, keepdim=True)
        better = err < best_err
        best_err, best_scale = torch.where(better, err, best_err), torch.where(better, scale, best_scale)
    return best_scale


def quantize_int4(
    weight: torch.Tensor,
    group: int = 64,
    search: bool = True,
    importance: torch.Tensor | None = None,
    deltas: tuple[float, ...] = INT4_STEP_DELTAS,
) -> QuantLinear:
    """Asymmetric 4-bit per group of ``group`` input columns: ``w ~ q * scale + offset``, q in 0..15.

    ``search``: each group's scale and offset minimise its squared error over candidate steps
    (``INT4_STEP_DELTAS``, each code assignment refitted by least squares, then its codes re-rounded and refitted
    once); without it plain round-to-nearest on the group's min/max (vLLM's ``rtn``). ``importance`` (K,) > 0: the
    search's squared errors weighted per input column (``imatrix.py``); ``deltas``: the candidate steps' d."""
    if group not in INT4_GROUPS:
        raise ValueError(f"4-bit group size must be one of {INT4_GROUPS}, got {group}")
    w = weight.detach().float()
    n, k = w.shape
    padded = -(-k // group) * group
    g = F.pad(w, (0, padded - k)).view(n, padded // group, group)
    imp = None if importance is None else F.pad(importance.float(), (0, padded - k), value=1.0)
    scale, offset = int4_group_scales(g, search, imp, deltas)
    q = int4_codes(g, scale, offset).view(n, padded)
    return int4_from_codes(q, scale.squeeze(2), offset.squeeze(2), group, k)


def int4_group_scales(
    g: torch.Tensor,
    search: bool = True,
    importance: torch.Tensor | None = None,
    deltas: tuple[float, ...] = INT4_STEP_DELTAS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, offset), each (rows, groups, 1), for the groups ``g`` (rows, groups, size) fp32: searched (in C where
    the kernels run, ``csrc/qsearch.c``; else ``_int4_search``), or min/max round-to-nearest. ``importance``
    (groups * size,) > 0 weights the search's squared errors per column."""
    n, groups, size = g.shape
    if search and _kernels_on() and size <= max(INT4_GROUPS):
        from nxdserve.engine.models.cpu_weight_kernels import quant_search

        candidates = [15 + d for d in deltas]
        scale, offset = quant_search(g.reshape(n, groups * size), size, candidates, "int4", importance)
        assert offset is not None
        return scale.unsqueeze(2), offset.unsqueeze(2)
    lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    span = (hi - lo).clamp_min(1e-12)
    if not search:
        return span / 15.0, lo
    return _int4_search(g, lo, span, None if importance is None else importance.view(groups, size), deltas)


def int4_codes(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The codes (int32, 0..15) of ``w`` on the grid ``q * scale + offset`` (broadcast), round-to-nearest."""
    return torch.round((w - offset) / scale).clamp_(0, 15).to(torch.int32)


def _int4_search(
    g: torch.Tensor,
    lo: torch.Tensor,
    span: torch.Tensor,
    importance: torch.Tensor | None = None,
    deltas: tuple[float, ...] = INT4_STEP_DELTAS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squared-error (scale, offset) per group of ``g`` (rows, groups, group) among the candidates; with
    ``importance`` (groups, group) > 0 each element's squared error weighted by its column's."""
    size = g.shape[2]
    a = None if importance is None else importance.unsqueeze(0)
    sum_a = size if a is None else a.sum(2, keepdim=True)
    sum_x = g.sum(dim=2, keepdim=True) if a is None else (a * g).sum(2, keepdim=True)

    def weighted(t: torch.Tensor) -> torch.Tensor:
        return t.sum(2, keepdim=True) if a is None else (a * t).sum(2, keepdim=True)

    def fit(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Least squares of w ~ q * s + m over the group; a group whose codes are all equal keeps the RTN step.
        sum_q, sum_qq, sum_qx = weighted(q), weighted(q * q), weighted(q * g)
        det = sum_a * sum_qq - sum_q * sum_q
        s = torch.where(det > 0, (sum_a * sum_qx - sum_q * sum_x) / det.clamp_min(1e-30), span / 15.0)
        m = (sum_x - s * sum_q) / sum_a
        return s, m, weighted((q * s + m - g).square_())

    rtn_scale = span / 15.0
    best_s, best_m = rtn_scale, lo
    best_err = weighted((torch.round((g - lo) / rtn_scale).clamp_(0, 15) * rtn_scale + lo - g).square_())
    for delta in deltas:
        s, m, _ = fit(torch.round((g - lo) * ((15 + delta) / span)).clamp_(0, 15))
        s = torch.where(s > 0, s, rtn_scale)
        s, m, err = fit(torch.round((g - m) / s).clamp_(0, 15))
        better = (err < best_err) & (s > 0)
        best_err = torch.where(better, err, best_err)
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
    return best_s, best_m


def int4_from_codes(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int, in_features: int
) -> QuantLinear:
    """``w = codes * scale + offset`` per group: codes (N, K_padded) in 0..15; scale, offset (N, K_padded/group).
    Kept as the C kernel reads them: two codes a byte in GGUF's order, the scales repeated per 32 columns."""
    n, padded = codes.shape
    if group % 32 or padded % group:
        raise ValueError(f"4-bit codes: group {group} must be a multiple of 32 dividing {padded} columns")
    blocks = codes.to(torch.uint8).view(n, padded // 32, 2, 16)
    data = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, padded // 2).contiguous()
    # Kept to K rounded up to 32 (the codes past it are zeros): a per-channel checkpoint's small K padded to a
    # group of 128 would otherwise carry up to 3 blocks of padding per row.
    kept = -(-in_features // 32) * 32
    data = data[:, : kept // 2].contiguous()
    scales, offsets = (t.float().repeat_interleave(group // 32, dim=1)[:, : kept // 32].contiguous()
                       for t in (scale, offset))  # fmt: skip
    return QuantLinear("int4", n, in_features, data, scales, group, kept, offsets)


# --quantization names (vLLM's where vLLM has one) -> (kind, group).
METHODS: dict[str, tuple[str, int]] = {
    "fp8": ("fp8", 0),
    "int8": ("int8", 0),
    "rtn-int8": ("int8", 0),  # vLLM's "rtn" (round-to-nearest) with RTN_NUM_BITS=8
    "int4": ("int4", 32),  # group 32: the one 4-bit group within 10% perplexity on the default model
    "rtn": ("int4", 128),  # vLLM's "rtn" default: 4 bits, group 128, plain round-to-nearest (no scale search)
    # groups 64 / 128: the activation-weighted search calibrated at load (CALIBRATED_GROUPS, imatrix.py), group 128
    # with activation-aware input scales (awq.py)
    **{f"int4-g{g}": ("int4", g) for g in INT4_GROUPS},
}


def store_bf16(weight: torch.Tensor) -> QuantLinear:
    """A dense (N, K) weight kept in bfloat16 and multiplied in fp32 (``CpuOptions.bf16_weights``): a CPU without
    native bf16 arithmetic reads half of fp32's bytes a decode step through the kernel's bf16 rows, which widen
    each value by a shift; calls above ``kernel_rows()`` rows widen a transient fp32 copy."""
    n, k = weight.shape
    return QuantLinear("bf16", n, k, weight.detach().to(torch.bfloat16).contiguous(), torch.empty(0))


def quantize_q8_0(weight: torch.Tensor) -> QuantLinear:
    """GGUF's Q8_0 layout from a dense (N, K) weight, K a multiple of 32: int8 codes, one scale (absmax / 127) per
    32 inputs; what a Q4_1 GGUF file stores its LM head in."""
    n, k = weight.shape
    blocks = weight.detach().float().view(n, k // 32, 32)
    scale = blocks.abs().amax(dim=2) / 127.0
    codes = torch.round(blocks / scale.clamp_min(1e-30).unsqueeze(2)).clamp_(-127, 127).to(torch.int8)
    return QuantLinear("q8_0", n, k, codes.view(n, k).contiguous(), scale.contiguous(), group=32, padded_in=k)


def lm_head_format(weight: torch.Tensor, method: str) -> QuantLinear | None:
    """The LM head under an online ``method``: dense (as vLLM's online methods leave it), except the 4-bit
    methods' on an fp32 model, whose head is stored as Q8_0 blocks as in a Q4_1 GGUF file (the fp32 head was
    113 of the 193 MB the default model's int4 decode step read, and 0.96x llama.cpp's single stream on its Q4_1
    file with the AVX2 kernels; perplexity: docs/quantization.md)."""
    kind, _ = METHODS[method]
    if kind == "int4" and method != "rtn" and weight.dtype == torch.float32 and weight.shape[1] % 32 == 0:
        return quantize_q8_0(weight)
    return None


def quantize(weight: torch.Tensor, method: str) -> QuantLinear:
    """One weight in ``method``'s format, without calibration: for groups in ``CALIBRATED_GROUPS`` this is the
    plain search; ``quantize_model`` serves those with the calibrated one (``imatrix.py``, ``awq.py``)."""
    kind, group = METHODS[method]
    if kind == "int8":
        return quantize_int8(weight)
    if kind == "fp8":
        return quantize_fp8(weight, 0, search=False) if fp8_per_channel_absmax else quantize_fp8(weight)
    return quantize_int4(weight, group, search=method != "rtn")


def quantize_model(
    model: Any,
    method: str,
    gguf_path: Path | None = None,
    checkpoint: Path | None = None,
    lora: bool = False,
    make: LinearMaker | None = None,
    tune_epochs: int | None = None,
) -> None:
    """Apply ``--quantization method`` to a loaded ``LlamaFamilyModel``: quantize its dense linears (a name in
    ``METHODS``; 4-bit groups over 32 calibrated on a text tokenized with ``checkpoint``'s tokenizer: ``awq.py``'s
    activation-aware scales, folded into the norms, unless ``lora``: adapters read the linears' original inputs),
    or put a file's own codes in their place: ``gguf`` (the .gguf file's blocks) or ``compressed-tensors`` (the
    ``checkpoint`` folder's, ``compressed_tensors.py``). ``make``: ``linear_quantizer``'s for this method where the
    caller has it (the linears it already quantized at load are skipped). ``tune_epochs``: the groups in
    ``qtune.TUNED_GROUPS`` then get their scales and offsets tuned against the dense model for that many epochs
    (None: ``qtune.EPOCHS``; 0: not tuned)."""
    if make is None:
        make = linear_quantizer(method, model.spec, len(model.layers), gguf_path, checkpoint)
    if make is not None:
        model.quantize_linears(make)
        return
    from nxdserve.engine.models import qtune
    from nxdserve.engine.models.awq import SCALED_GROUPS, quantize_model_awq
    from nxdserve.engine.models.imatrix import quantize_model_imatrix

    # The calibrated 4-bit groups: the LM head as lm_head_format.
    group = METHODS[method][1]
    # The teacher is read before the calibration changes anything (awq.py folds its scales into the norms).
    epochs = qtune.EPOCHS if tune_epochs is None else tune_epochs
    targets = None
    if group in qtune.TUNED_GROUPS and epochs > 0 and checkpoint is not None:  # None: the calibration refuses
        if qtune.supports(model):
            targets = qtune.teacher_targets(model, checkpoint)
        else:
            logger.info("%s: group scales not tuned (qtune does not model %s)", method, type(model).__name__)
    if group in SCALED_GROUPS and not lora:
        quantize_model_awq(model, group, checkpoint)
    else:
        quantize_model_imatrix(model, group, checkpoint)
    if targets is not None:
        qtune.tune_scales(model, targets, epochs)


def linear_quantizer(
    method: str, spec: Any, num_layers: int, gguf_path: Path | None = None, checkpoint: Path | None = None
) -> LinearMaker | None:
    """``method``'s quantized weight for each linear from its dense weight alone, or None for the methods that
    calibrate on the dense model first (4-bit groups over 32). A ``LinearMaker`` can quantize each linear as the
    checkpoint loads (``LlamaFamilyModel.from_pretrained``), so the dense model is never whole in memory.
    ``spec``: the model's ``ModelSpec`` (a .gguf file's q/k rows are permuted by head). Raises ConfigError for a
    method that cannot apply (an unknown name, a file without the blocks)."""
    if method == "compressed-tensors":
        from nxdserve.engine.models.compressed_tensors import CompressedCheckpoint

        if checkpoint is None:
            raise ConfigError("--quantization compressed-tensors: needs the checkpoint folder.")
        quantized = CompressedCheckpoint(checkpoint).quantized_linears(num_layers)
        if not quantized:
            raise ConfigError(f"--quantization compressed-tensors: {checkpoint} holds no quantized linears.")
        return lambda name, _weight: quantized.get(name)
    if method == "gguf":
        from nxdserve.engine.models.gguf_weights import load_quantized_linears
        from nxdserve.engine.models.llama import LlamaFamilyModel

        if gguf_path is None or gguf_path.suffix != ".gguf":
            raise ConfigError("--quantization gguf: the model must be a .gguf file (or the default model).")
        table = load_quantized_linears(gguf_path, spec.num_heads, spec.num_kv_heads)
        wanted = [f"layers.{i}.{a}" for i in range(num_layers) for a in LlamaFamilyModel.QUANTIZABLE]
        missing = [name for name in wanted if name not in table]
        if missing:
            raise ConfigError(f"--quantization gguf: {gguf_path.name} has no quantized blocks for {missing[:4]}.")
        return lambda name, _weight: table.get(name)
    if method not in METHODS:
        raise ConfigError(f"--quantization {method!r}: expected one of {', '.join(METHODS)} or gguf.")
    kind, group = METHODS[method]
    if kind == "int4" and group in CALIBRATED_GROUPS and method != "rtn":
        return None
    # The LM head stays dense for int8 / fp8 (lm_head_format): on the default model quantizing the tied head
    # too cost int8 1.6% and fp8 3% perplexity (over the 1% bound; perf_notes.md), as in vLLM, whose online
    # methods leave it dense.
    return lambda name, weight: lm_head_format(weight, method) if name == "lm_head" else quantize(weight, method)
