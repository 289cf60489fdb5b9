"""The C kernels over weights in their stored forms: the quantized-weight GEMM for a few rows (``QgemmWeight``,
csrc/qgemm.c and qgemm_i8.c), multi-LoRA (``lora_add``, csrc/lora.c) and the quantizers' scale searches and GPTQ
loop at load (``quant_search``, ``gptq_int4``, csrc/qsearch.c). Their args structs and the running library are
``cpu_kernels``' (looked up at each call); callers check ``cpu_kernels.available()``.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import torch

from nxdserve.engine.models import cpu_kernels
from nxdserve.engine.models.cpu_kernels import GptqArgs, LoraArgs, QgemmArgs, QsearchArgs

# -- quantized-weight GEMM for a few rows (csrc/qgemm.c) ------------------------------------------------------------
QGEMM_FORMATS = {"q4": 0, "q8": 1, "fp8": 2, "bf16": 3}
QGEMM_BLOCK = 32


class QgemmWeight:
    """A quantized weight as ``qgemm_f32`` reads it (``csrc/qgemm.c``), with its args struct filled once: a call
    sets only the activations' fields on a copy (a decode step makes ~120 of these calls; each costs ~6 us of Python).

    ``fmt`` "q4": codes uint8 (N, K/2) in GGUF's nibble order, scale and offset fp32 (N, K/32); "q8": codes int8
    (N, K), scale (N, K/32); "fp8": codes float8_e4m3fn / uint8 (N, K), scale (N, K/32); "bf16": the weight in
    bfloat16 (N, K), no scale. K a multiple of 32."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None, fmt: str) -> None:
        n = codes.shape[0]
        k = codes.shape[1] * (2 if fmt == "q4" else 1)
        if (scale is None) != (fmt == "bf16") or (fmt == "bf16" and codes.dtype != torch.bfloat16):
            raise ValueError("qgemm: bf16 weights take no scales and are bfloat16, the other formats scales")
        scale_ok = scale is None or (scale.dtype == torch.float32 and scale.is_contiguous())
        if k % QGEMM_BLOCK or not codes.is_contiguous() or not scale_ok:
            raise ValueError("qgemm: K must be a multiple of 32, codes contiguous, scales contiguous fp32")
        if (offset is not None) != (fmt == "q4") or (offset is not None and not offset.is_contiguous()):
            raise ValueError("qgemm: q4 takes contiguous offsets, the other formats none")
        self.tensors = (codes, scale, offset)  # kept alive: the struct holds their addresses
        self.out_features, self.in_features = n, k
        self.args = QgemmArgs()
        self.args.K, self.args.N, self.args.format = k, n, QGEMM_FORMATS[fmt]
        self.args.w, self.args.scale = codes.data_ptr(), None if scale is None else scale.data_ptr()
        self.args.offset = None if offset is None else offset.data_ptr()

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, int8_activations: bool = False
    ) -> torch.Tensor:
        """``x (M, K) @ W^T [+ residual]``: x fp32 (M, K) with contiguous rows, residual fp32 (M, N) likewise.
        ``int8_activations``: x's rows rounded to int8 per 32-block and integer dot products (``qgemm_i8_f32``,
        csrc/qgemm_i8.c; q4 and q8, fp8 stays exact). Callers check ``cpu_kernels.available()``."""
        return self._run(x, residual, int8_activations, None)

    def argmax(self, x: torch.Tensor, cols: int, int8_activations: bool = False) -> torch.Tensor:
        """(M,) int64: ``cpu_kernels.argmax(self(x, None, int8_activations)[:, :cols])``, the same indices, kept as
        the kernel writes its outputs (``q_best`` in csrc/qgemm.c), so that the logits are never read back: a greedy
        LM head."""
        if not 0 < cols <= self.out_features:
            raise ValueError(f"argmax over {cols} of {self.out_features} columns")
        tokens = torch.empty(x.shape[0], dtype=torch.long)
        self._run(x, None, int8_activations, (tokens, cols))
        return tokens

    def _run(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        int8_activations: bool,
        argmax: tuple[torch.Tensor, int] | None,
    ) -> torch.Tensor:
        lib = cpu_kernels._library()
        assert lib is not None and x.dtype == torch.float32 and x.shape[1] == self.in_features and x.stride(1) == 1
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        a = QgemmArgs.from_buffer_copy(self.args)  # a copy (~1 us): calls from two threads never share one
        a.x, a.M, a.xs, a.out, a.os = x.data_ptr(), rows, x.stride(0), out.data_ptr(), self.out_features
        a.nthreads = torch.get_num_threads()
        if residual is None:
            a.res, a.rs = None, 0
        else:
            assert residual.dtype == torch.float32 and residual.shape == out.shape and residual.stride(1) == 1
            a.res, a.rs = residual.data_ptr(), residual.stride(0)
        if argmax is not None:
            a.argmax, a.argmax_cols = argmax[0].data_ptr(), argmax[1]
        (lib.qgemm_i8_f32 if int8_activations else lib.qgemm_f32)(ctypes.byref(a))
        return out

    def to_f32(self) -> torch.Tensor:
        """The whole weight widened to fp32 (N, K) over the intra-op threads (``q_widen_f32``, csrc/qgemm.c), into
        this thread's buffer, valid until its next call: a call of many rows (a prefill chunk) multiplies by it
        with the dense GEMM and keeps nothing. A fresh allocation per call page-faulted its way in (a prefill chunk
        widens every linear) and cost as much again as the widening."""
        lib = cpu_kernels._library()
        assert lib is not None
        size = self.out_features * self.in_features
        buffer = getattr(_widened, "buffer", None)
        if buffer is None or buffer.numel() < size:
            buffer = _widened.buffer = torch.empty(size, dtype=torch.float32)
        out = buffer[:size].view(self.out_features, self.in_features)
        a = QgemmArgs.from_buffer_copy(self.args)
        a.nthreads = torch.get_num_threads()
        lib.q_widen_f32(ctypes.byref(a), out.data_ptr())
        return out


_widened = threading.local()  # per thread: the fp32 buffer QgemmWeight.to_f32 widens into


def qgemm(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor | None,
    offset: torch.Tensor | None,
    fmt: str,
    residual: torch.Tensor | None = None,
    int8_activations: bool = False,
) -> torch.Tensor:
    """``x (M, K) @ W^T [+ residual]`` in fp32 for a quantized W (``QgemmWeight`` says the formats)."""
    return QgemmWeight(codes, scale, offset, fmt)(x, residual, int8_activations)


# -- multi-LoRA (csrc/lora.c) -----------------------------------------------------------------------------------


def lora_args(
    a: torch.Tensor, b_t: torch.Tensor, ranks: torch.Tensor, starts: torch.Tensor, scale: torch.Tensor | None = None
) -> LoraArgs:
    """The args of ``lora_add`` for one linear's stacked adapters, built once (the per-call fields, x/idx/out, are
    set by ``lora_add``): ``a`` (n_adapters, S*rmax, in) and ``b_t`` = B transposed (n_adapters, rmax, out),
    contiguous, adapter i using the first ``ranks[i]`` (int32, <= rmax) rows of each module's rmax; ``starts``
    (S+1,) int64, the packed modules' output column bounds; ``scale`` (n_adapters,) fp32 or None (scales folded
    into B). The args hold the tensors; their contents may change between calls (adapters loaded in place)."""
    n, width, fan_in = a.shape
    rmax, fan_out = b_t.shape[1], b_t.shape[2]
    parts = starts.shape[0] - 1
    assert a.is_contiguous() and b_t.is_contiguous() and starts.is_contiguous() and starts.dtype == torch.int64
    assert b_t.shape[0] == n and width == parts * rmax and int(starts[-1]) == fan_out and a.dtype == b_t.dtype
    assert ranks.dtype == torch.int32 and ranks.is_contiguous() and ranks.shape == (n,)
    assert scale is None or (scale.dtype == torch.float32 and scale.is_contiguous() and scale.shape == (n,))
    args = LoraArgs()
    args.K, args.N, args.S, args.rmax = fan_in, fan_out, parts, rmax
    args.a, args.b, args.ranks, args.starts = a.data_ptr(), b_t.data_ptr(), ranks.data_ptr(), starts.data_ptr()
    args.scale = None if scale is None else scale.data_ptr()
    args.keep, args.dtype = (a, b_t, ranks, starts, scale), a.dtype
    return args


def lora_add(args: LoraArgs, out: torch.Tensor, x: torch.Tensor, idx: torch.Tensor) -> None:
    """``out[m] += scale B A x[m]`` with row m's own adapter ``idx[m]`` (int32, contiguous; -1: none), in place,
    for CPU ``x`` (M, in) and ``out`` (M, out) in the args' dtype (bf16/fp32) with contiguous rows. Kept lean
    (the forward calls it per linear and layer): the caller guarantees the shapes."""
    lib = cpu_kernels._library()
    assert lib is not None and x.stride(1) == 1 and out.stride(1) == 1
    if x.dtype != args.dtype or out.dtype != args.dtype:
        raise TypeError(f"lora_add: x {x.dtype} and out {out.dtype} must be the adapters' {args.dtype}")
    args.x, args.M, args.xs = x.data_ptr(), x.shape[0], x.stride(0)
    args.idx, args.out, args.os = idx.data_ptr(), out.data_ptr(), out.stride(0)
    args.nthreads = torch.get_num_threads()
    (lib.lora_add_bf16 if x.dtype == torch.bfloat16 else lib.lora_add_f32)(ctypes.byref(args))


# -- the quantizers' scale searches at load (csrc/qsearch.c) ------------------------------------------------------
QSEARCH_KINDS = {"int4": 0, "fp8": 1}


def quant_search(
    weight: torch.Tensor, group: int, candidates: Sequence[float], kind: str, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``quant.py``'s scale search per group of ``group`` columns of ``weight`` (N, K) fp32, K a multiple of
    ``group``: int4 (group <= 128; ``candidates`` the steps' 15 + d) -> (scale, offset), fp8 (``candidates`` the
    multipliers of absmax / 448) -> (scale, None); each (N, K / group) fp32. ``importance`` (K,) > 0: int4's squared
    errors weighted per input column. Callers check ``cpu_kernels.available()``."""
    lib = cpu_kernels._library()
    assert lib is not None
    n, k = weight.shape
    if k % group or weight.dtype != torch.float32 or (kind == "int4" and group > 128):
        raise ValueError(f"quant_search: fp32 weight with K ({k}) a multiple of group ({group}), int4 groups <= 128")
    w = weight.contiguous()
    cand = torch.tensor(list(candidates), dtype=torch.float32)
    scale = torch.empty(n, k // group, dtype=torch.float32)
    offset = torch.empty_like(scale) if kind == "int4" else None
    imp = None if importance is None else importance.float().contiguous()
    if imp is not None and (imp.shape != (k,) or kind != "int4"):
        raise ValueError(f"quant_search: importance is int4's, one per column ({k})")
    args = QsearchArgs(
        w.data_ptr(), n, k, group, cand.data_ptr(), cand.numel(), None if imp is None else imp.data_ptr(),
        scale.data_ptr(),
        None if offset is None else offset.data_ptr(), QSEARCH_KINDS[kind], torch.get_num_threads(),
    )  # fmt: skip
    fn = lib.quant_search_f32
    fn.argtypes, fn.restype = [ctypes.POINTER(QsearchArgs)], None
    fn(ctypes.byref(args))
    return scale, offset


def gptq_int4(
    weight: torch.Tensor, upper: torch.Tensor, group: int, candidates: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's column loop (``gptq.py``) on ``weight`` (N, K) fp32 with ``upper`` (K, K) fp32, the upper Cholesky
    factor of the damped H^-1, K a multiple of ``group`` (<= 128): (codes uint8 (N, K), scale, offset (N, K /
    group)). ``weight`` is not changed (the loop updates a copy). Callers check ``cpu_kernels.available()``."""
    lib = cpu_kernels._library()
    assert lib is not None
    n, k = weight.shape
    if k % group or group > 128 or upper.shape != (k, k) or {weight.dtype, upper.dtype} != {torch.float32}:
        raise ValueError(f"gptq_int4: fp32 weight (N, K) and upper (K, K), K ({k}) a multiple of group ({group})")
    w = weight.clone(memory_format=torch.contiguous_format)
    u = upper.contiguous()
    cand = torch.tensor(list(candidates), dtype=torch.float32)
    codes = torch.empty(n, k, dtype=torch.uint8)
    scale = torch.empty(n, k // group, dtype=torch.float32)
    offset = torch.empty_like(scale)
    args = GptqArgs(
        w.data_ptr(), n, k, group, u.data_ptr(), cand.data_ptr(), cand.numel(), codes.data_ptr(), scale.data_ptr(),
        offset.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    fn = lib.gptq_int4_f32
    fn.argtypes, fn.restype = [ctypes.POINTER(GptqArgs)], None
    fn(ctypes.byref(args))
    return codes, scale, offset
