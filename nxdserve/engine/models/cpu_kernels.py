"""The C kernels of the CPU forward (``nxdserve/csrc``), built once per ISA variant and loaded through ctypes.

``slot_attention``: write every new token's K/V into its slot's cache line, then, for each selected
token, attend to its slot's keys ``lo..pos`` (``lo`` from a sliding window) with all query heads of a KV
head group sharing each key and value read. It reads the cache lines in place: no padding to the
longest row, no gather of K/V and no mask. Measured on a 2-core AVX512-BF16 EPYC, it is 2.5-3x faster
than ``F.scaled_dot_product_attention`` for decode rows in bf16 (the CPU flash kernel pays a lot per
(row, head) at one query), and 1.5-2x in fp32; results agree with SDPA to rounding (fp32 ~1e-7).
Long prefill chunks stay on SDPA (their GEMMs reuse each key across many queries).

Elementwise layer ops (``rms_norm`` with an optional residual add, ``rope_`` in place, ``silu_mul``)
replace the ~25 small torch ops of a decoder layer with 4 calls, rounding exactly where the eager ops do.

Builds (one per ISA variant, cached, chosen by the CPU's flags): ``cpu_build``. The long calls pass one args
struct (``nxdserve_kernels.h``), declared again below as ``ctypes.Structure``; a build whose struct layouts differ
from these is refused. Without a compiler, or with ``isa="none"``, ``available()`` is False and the model runs its
torch ops and SDPA. The kernels over weights in their stored forms (quantized GEMM, multi-LoRA, the quantizers'
searches): ``cpu_weight_kernels``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from nxdserve.engine.models import cpu_build
from nxdserve.errors import ConfigError

logger = logging.getLogger(__name__)

MAX_GROUP = 16  # query heads per KV head
MAX_HEAD_DIM = 256


# -- the args structs of nxdserve_kernels.h ----------------------------------------------------------------------
_p, _i64, _f32, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32


def _fields(spec: str, kind: Any) -> list[tuple[str, Any]]:
    return [(name, kind) for name in spec.split()]


class AttentionArgs(ctypes.Structure):
    _fields_ = [
        *_fields("q", _p), *_fields("q_st q_sh", _i64), *_fields("k", _p), *_fields("k_st k_sh", _i64),
        *_fields("v", _p), *_fields("v_st v_sh", _i64), *_fields("k_cache v_cache", _p),
        *_fields("c_ss c_sh", _i64), *_fields("slots pos", _p), *_fields("ntok", _i64), *_fields("sel", _p),
        *_fields("nsel hkv group head_dim window", _i64), *_fields("out", _p), *_fields("o_st", _i64),
        ("scale", _f32), ("nthreads", _i32), ("kv_fp8", _i32), ("v_scale", _f32),
    ]  # fmt: skip


class GemmArgs(ctypes.Structure):
    _fields_ = [
        *_fields("x", _p), *_fields("M K xs", _i64), *_fields("wp cw bias res", _p), *_fields("rs N", _i64),
        *_fields("out", _p), *_fields("os", _i64), ("nthreads", _i32),
    ]  # fmt: skip


class DecodeArgs(ctypes.Structure):
    _fields_ = [
        *_fields("x", _p), *_fields("T", _i64), *_fields("lw windows", _p), *_fields("L", _i64),
        *_fields("final_norm cos sin slots pos", _p), *_fields("H NH NKV D I c_ss c_sh", _i64),
        *_fields("ws fs", _p), *_fields("A", _i64), *_fields("alt_kv silu_tab keep", _p), *_fields("K", _i64),
        *_fields("kv_scales", _p), ("eps", _f32), ("nthreads", _i32), ("kv_fp8", _i32),
    ]  # fmt: skip


class GreedyHeadArgs(ctypes.Structure):
    _fields_ = [
        *_fields("x", _p), *_fields("M K xs", _i64), *_fields("rest", _p), *_fields("KR", _i64),
        *_fields("S", _p), *_fields("KS", _i64), *_fields("wq ws colp csum wfull", _p), *_fields("N", _i64),
        *_fields("out xq xsb rowf list_idx list_hi", _p), ("nthreads", _i32),
    ]  # fmt: skip


class QgemmArgs(ctypes.Structure):
    _fields_ = [
        *_fields("x", _p), *_fields("M K xs", _i64), *_fields("w scale offset res", _p), *_fields("rs N", _i64),
        *_fields("out", _p), *_fields("os", _i64), ("format", _i32), ("nthreads", _i32), *_fields("argmax", _p),
        *_fields("argmax_cols", _i64),
    ]  # fmt: skip


class QdecodeArgs(ctypes.Structure):
    """``qdecode_forward_f32``'s args: the fused quantized forward (``fused_qdecode.py``)."""

    _fields_ = [
        *_fields("x", _p), *_fields("T", _i64), *_fields("lw formats windows", _p), *_fields("L", _i64),
        *_fields("final_norm cos sin slots pos", _p), *_fields("H NH NKV D I c_ss c_sh", _i64),
        *_fields("kv_scales alt_kv", _p), *_fields("A", _i64), ("eps", _f32), ("nthreads", _i32),
        ("int8_activations", _i32), ("kv_fp8", _i32),
    ]  # fmt: skip


class LoraArgs(ctypes.Structure):
    _fields_ = [
        *_fields("x", _p), *_fields("M K xs", _i64), *_fields("idx a b scale ranks starts", _p),
        *_fields("S rmax N", _i64), *_fields("out", _p), *_fields("os", _i64), ("nthreads", _i32),
    ]  # fmt: skip
    keep: tuple[torch.Tensor | None, ...]  # the tensors the pointers point into, alive as long as the args
    dtype: torch.dtype  # theirs: x and out must have it


class QsearchArgs(ctypes.Structure):
    _fields_ = [
        *_fields("w", _p), *_fields("N K group", _i64), *_fields("cand", _p), *_fields("ncand", _i64),
        *_fields("importance scale offset", _p), ("kind", _i32), ("nthreads", _i32),
    ]  # fmt: skip


class GptqArgs(ctypes.Structure):
    _fields_ = [
        *_fields("w", _p), *_fields("N K group", _i64), *_fields("u cand", _p), *_fields("ncand", _i64),
        *_fields("codes scale offset", _p), ("nthreads", _i32),
    ]  # fmt: skip


QDECODE_LAYER_POINTERS = 20  # nxdserve_kernels.h

STRUCTS: dict[str, type[ctypes.Structure]] = {
    "nxd_attention_args": AttentionArgs,
    "nxd_qgemm_args": QgemmArgs,
    "nxd_qdecode_args": QdecodeArgs,
    "nxd_gemm_args": GemmArgs,
    "nxd_decode_args": DecodeArgs,
    "nxd_greedy_head_args": GreedyHeadArgs,
    "nxd_lora_args": LoraArgs,
    "nxd_qsearch_args": QsearchArgs,
    "nxd_gptq_args": GptqArgs,
}


class _FieldLayout(ctypes.Structure):
    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", _i64), ("size", _i64)]


def check_layouts(lib: ctypes.CDLL, structs: dict[str, type[ctypes.Structure]] | None = None) -> None:
    """Raise RuntimeError unless every struct's size and every field's offset and size in ``lib``
    (``nxd_struct_layouts``) equal ctypes' for ``structs`` (default: ``STRUCTS``), field for field."""
    structs = STRUCTS if structs is None else structs
    fn = lib.nxd_struct_layouts
    fn.argtypes = [ctypes.POINTER(_i64)]
    fn.restype = ctypes.POINTER(_FieldLayout)
    count = _i64()
    entries = fn(ctypes.byref(count))
    c_side: dict[str, dict[str | None, tuple[int, int]]] = {}
    for i in range(count.value):
        e = entries[i]
        field = None if e.field is None else e.field.decode()
        c_side.setdefault(e.type.decode(), {})[field] = (e.offset, e.size)
    for name, struct in structs.items():
        py_side: dict[str | None, tuple[int, int]] = {None: (0, ctypes.sizeof(struct))}
        for field_name, *_ in struct._fields_:  # (name, type[, bit width])
            descr = getattr(struct, field_name)
            py_side[field_name] = (descr.offset, descr.size)
        if c_side.get(name) != py_side:
            raise RuntimeError(f"{name}: the library's layout {c_side.get(name)} is not ctypes' {py_side}")


_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "slot_attention": ([ctypes.POINTER(AttentionArgs)], None),
    "slot_attention_fp8": ([ctypes.POINTER(AttentionArgs)], None),
    "add_rmsnorm": ([_p, _p, _p, _f32, _p, _p, _i64, _i64, ctypes.c_int], None),
    "rope": ([_p, _i64, _i64, _i64, _i64, _p, _p, ctypes.c_int], None),
    "silu_mul": ([_p, _p, _i64, _i64, ctypes.c_int], None),
    "argmax_rows": ([_p, _i64, _i64, _i64, _p, ctypes.c_int], None),
    "lora_add": ([ctypes.POINTER(LoraArgs)], None),
}
_OPTIONAL: dict[str, dict[str, tuple[list[Any], Any]]] = {  # by availability probe: parts of AVX512 builds
    "decode_forward_available": {
        "decode_forward_bf16": ([ctypes.POINTER(DecodeArgs)], None),
        "decode_forward_scratch": ([_i64, _i64, _i64, _i32], _i64),
        "decode_forward_fp8_store": ([_p, _p, _i64, _i32, _f32], None),
        "decode_forward_fp8_widen": ([_p, _p, _i64, _i32], None),
        "decode_forward_set_block_min": ([_i64], None),
        "decode_forward_block_min": ([], _i64),
        "decode_forward_silu_mul": ([_p, _p, _p, _p, _i64], None),
    },
    "greedy_head_available": {"greedy_head_argmax": ([ctypes.POINTER(GreedyHeadArgs)], _i64)},
    "gemm_available": {
        "gemm_bf16": ([ctypes.POINTER(GemmArgs)], None),
        "gemm_set_work_stealing": ([ctypes.c_int], None),
        "gemm_set_x_block_bytes": ([_i64], None),
    },
}


def load(path: Path) -> ctypes.CDLL:
    """Load a built library (RTLD_LOCAL: several variants can live in one process), bind its functions and check
    its struct layouts; raises on any failure."""
    import torch.nn.functional  # noqa: F401  - torch (and its OpenMP runtime) first

    lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
    check_layouts(lib)
    for name, (argtypes, restype) in _SIGNATURES.items():
        for suffix in ("bf16", "f32"):
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes, fn.restype = argtypes, restype
    for probe, functions in _OPTIONAL.items():
        getattr(lib, probe).restype = ctypes.c_int
        if getattr(lib, probe)():
            for name, (argtypes, restype) in functions.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, restype
    lib.qgemm_f32.argtypes, lib.qgemm_f32.restype = [ctypes.POINTER(QgemmArgs)], None
    lib.qgemm_i8_f32.argtypes, lib.qgemm_i8_f32.restype = [ctypes.POINTER(QgemmArgs)], None
    lib.q_widen_f32.argtypes, lib.q_widen_f32.restype = [ctypes.POINTER(QgemmArgs), _p], None
    lib.qdecode_forward_f32.argtypes, lib.qdecode_forward_f32.restype = [ctypes.POINTER(QdecodeArgs)], None
    lib.kv_fp8_store_f32.argtypes, lib.kv_fp8_store_f32.restype = [_p, _p, _i64, _i32, _f32], None
    lib.omp_bind_team.argtypes = [ctypes.c_int, _p, ctypes.c_int, ctypes.c_int]
    lib.omp_bind_team.restype = ctypes.c_int
    lib.gemm_amx.restype = ctypes.c_int
    lib.gemm_set_amx.argtypes = [ctypes.c_int]
    lib.gemm_set_amx.restype = ctypes.c_int
    return lib


_UNSET: Any = object()


class _Kernels:
    """Which path runs (``configure``) and the libraries loaded so far, by variant."""

    def __init__(self) -> None:
        self.isa = "auto"
        self.amx = True
        self.path: str | None = None  # resolved on first use
        self.current: ctypes.CDLL | None = _UNSET  # the library of ``path`` (None: torch ops), once resolved
        self.libs: dict[str, ctypes.CDLL | None] = {}
        self.parts: dict[str, int] = {}
        self.extra_flags: list[str] = []  # set_extra_build_flags


def set_extra_build_flags(flags: Sequence[str]) -> None:
    """Build every variant loaded from now on with these flags too (the sanitizer test); call before the first
    kernel runs."""
    _state.extra_flags = list(flags)
    _state.libs, _state.current, _state.parts = {}, _UNSET, {}


_state = _Kernels()


def build_running_variant(extra_flags: Sequence[str]) -> ctypes.CDLL:
    """The running path's library built with ``extra_flags`` too (compile-time switches, ``-DNAME=VALUE``) and
    loaded beside the others: ``benchmarks/kernel_ab.py`` times such builds against each other in one process.
    Raises RuntimeError on the torch path or a failed build."""
    variant = cpu_build.variant_of(_state.path or configure(_state.isa, _state.amx))
    if variant is None:
        raise RuntimeError("no C kernels run on this path")
    return load(cpu_build.build_variant(variant, extra_flags=[*_state.extra_flags, *extra_flags]))


@contextlib.contextmanager
def running_library(lib: ctypes.CDLL) -> Iterator[None]:
    """Every kernel call inside runs ``lib`` (one of ``build_running_variant``'s) instead of the path's own."""
    saved = _library()
    _state.current = lib
    try:
        yield
    finally:
        _state.current = saved


def configure(isa: str = "auto", amx: bool = True) -> str:
    """Choose the kernels' path: ``isa`` as ``CpuOptions.isa``; ``amx`` False keeps the GEMMs off the tiles.
    Returns the path that will run ("amx", "avx512bf16", "avx2", "neon", "generic" or "none"). Raises ConfigError
    for a path this CPU cannot run (an "amx" the OS refuses included). Without a C compiler every path is "none"
    (one log line). Libraries are built (and cached) on first use, except for "amx", checked here."""
    runnable = cpu_build.runnable_paths()
    if isa == "auto":
        path = runnable[0] if amx or runnable[0] != "amx" else runnable[1]
    elif isa in runnable:
        path = isa
    else:
        raise ConfigError(
            f"cpu isa {isa!r} cannot run on this CPU ({cpu_build.machine()}); it can run: {', '.join(runnable)}."
        )
    if path != "none" and cpu_build.compiler() is None:
        logger.warning("no C compiler (CC=%r): the CPU forward runs torch ops", os.environ.get("CC"))
        path = "none"
    _state.isa, _state.amx, _state.path = isa, amx, path
    _state.current, _state.parts = _UNSET, {}
    if path == "amx":
        lib = _library()
        if lib is not None and not lib.gemm_amx():
            raise ConfigError("cpu isa 'amx': the CPU has AMX but the OS does not let this process use it.")
    return path


def active_path() -> str:
    """The path that runs now ("none" also when its library could not be built)."""
    lib = _library()
    if lib is None:
        return "none"
    return "avx512bf16" if _state.path == "amx" and not lib.gemm_amx() else str(_state.path)


def _library() -> ctypes.CDLL | None:
    lib = _state.current
    if lib is _UNSET:
        lib = _state.current = _resolve()
    return lib


def _resolve() -> ctypes.CDLL | None:
    path = _state.path if _state.path is not None else configure(_state.isa, _state.amx)
    variant = cpu_build.variant_of(path)
    if variant is None:
        return None
    if variant not in _state.libs:
        try:
            _state.libs[variant] = load(cpu_build.build_variant(variant, extra_flags=_state.extra_flags))
        except Exception as exc:  # any failure: fall back to the torch ops, loudly once
            logger.warning("CPU kernels (%s) unavailable (%s): using torch ops", variant, exc)
            _state.libs[variant] = None
    lib = _state.libs[variant]
    if lib is not None and variant == "avx512bf16":
        # Set before any GEMM runs on the OpenMP threads: "amx" (or auto) asks the OS for the tiles once,
        # "avx512bf16" (or amx=False) keeps them off.
        lib.gemm_set_amx(1 if path == "amx" else 0)
    return lib


def available() -> bool:
    return _library() is not None


def built(probe: str) -> bool:
    """Whether the running library has an optional part: ``probe`` names its C availability function
    (``gemm_available``, ``decode_forward_available``); those parts exist only in AVX512-BF16 builds."""
    return built_value(probe) != 0


def built_value(probe: str) -> int:
    """What the running library's ``probe`` function returns (0 without a library), asked once per library."""
    part = _state.parts.get(probe)
    if part is None:
        lib = _library()
        part = _state.parts[probe] = 0 if lib is None else int(getattr(lib, probe)())
    return part


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can run this attention (CPU, bf16/fp32, contiguous cache, no autograd)."""
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float32) or k_cache.dtype != q.dtype:
        return False
    if torch.is_grad_enabled() and q.requires_grad:
        return False
    num_heads, head_dim = q.shape[1], q.shape[2]
    groups = num_heads // k_cache.shape[1]
    return groups <= MAX_GROUP and head_dim <= MAX_HEAD_DIM and available()


def slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    select: torch.Tensor | None,
    num_select: int,
    window: int | None,
    out: torch.Tensor,
) -> None:
    """Write k/v (T, Hkv, D) at (slots, positions) of the caches (S, Hkv, L, D); attend the selected
    tokens' q (T, Hq, D) into ``out`` (T, Hq * D). ``select`` (int64) lists the attending tokens, None
    for the first ``num_select``. All index tensors are int64 on the CPU, contiguous."""
    lib = _library()
    assert lib is not None
    fn = lib.slot_attention_bf16 if q.dtype == torch.bfloat16 else lib.slot_attention_f32
    args = _attention_args(q, k, v, k_cache, v_cache, slots, positions, select, num_select, window, out, 1.0, 0, 1.0)
    fn(ctypes.byref(args))


def _attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    select: torch.Tensor | None,
    num_select: int,
    window: int | None,
    out: torch.Tensor,
    k_scale: float,
    kv_fp8: int,
    v_scale: float,
) -> AttentionArgs:
    """The args struct of both slot-attention kernels; ``kv_fp8``: 0 (cache in q's dtype), 1 (e4m3), 2 (e5m2)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert k_cache.stride(2) == head_dim and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and out.stride(1) == 1
    return AttentionArgs(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.stride(1), slots.data_ptr(), positions.data_ptr(), num_tokens,
        None if select is None else select.data_ptr(), num_select, num_kv_heads, num_heads // num_kv_heads,
        head_dim, window or 0, out.data_ptr(), out.stride(0), k_scale * head_dim**-0.5, torch.get_num_threads(),
        kv_fp8, v_scale,
    )  # fmt: skip


def supports_fp8(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the fp8-cache kernel can attend (``slot_attention_fp8``): as ``supports``, with an fp8 cache."""
    if k_cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or q.device.type != "cpu":
        return False
    if q.dtype not in (torch.bfloat16, torch.float32) or (torch.is_grad_enabled() and q.requires_grad):
        return False
    return q.shape[1] // k_cache.shape[1] <= MAX_GROUP and q.shape[2] <= MAX_HEAD_DIM and available()


def slot_attention_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    select: torch.Tensor | None,
    num_select: int,
    window: int | None,
    k_scale: float,
    v_scale: float,
    out: torch.Tensor,
) -> None:
    """``slot_attention`` over an fp8 cache (S, Hkv, L, D): writes the codes k/v (T, Hkv, D), already cast to the
    cache's dtype (``kv_quant.quantize``), at (slots, positions), then attends the selected tokens' q into ``out``,
    reading one byte per cached element. Cached values are ``code * k_scale`` / ``code * v_scale``."""
    lib = _library()
    assert lib is not None
    fn = lib.slot_attention_fp8_bf16 if q.dtype == torch.bfloat16 else lib.slot_attention_fp8_f32
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
    kv_fp8 = 1 if k_cache.dtype == torch.float8_e4m3fn else 2
    args = _attention_args(
        q, k, v, k_cache, v_cache, slots, positions, select, num_select, window, out, k_scale, kv_fp8, v_scale
    )
    fn(ctypes.byref(args))


# -- elementwise layer ops ----------------------------------------------------------------------------
# Callers check ``fusable(x)`` once per layer; tensors are row-major with contiguous rows.


def fusable(x: torch.Tensor) -> bool:
    """Whether the elementwise kernels can take activations like ``x`` (CPU, bf16/fp32, no autograd)."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and not (torch.is_grad_enabled() and x.requires_grad)
        and available()
    )


def _fn(name: str, dtype: torch.dtype) -> Any:
    lib = _library()
    assert lib is not None
    return getattr(lib, f"{name}_bf16" if dtype == torch.bfloat16 else f"{name}_f32")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta) * weight), rows of x (N, H); without ``delta``, (x, norm(x))."""
    rows, cols = x.shape
    assert x.is_contiguous() and weight.is_contiguous() and weight.dtype == x.dtype
    out = torch.empty_like(x)
    total = x
    if delta is not None:
        assert delta.is_contiguous() and delta.shape == x.shape and delta.dtype == x.dtype
        total = torch.empty_like(x)
    _fn("add_rmsnorm", x.dtype)(
        x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), eps,
        total.data_ptr(), out.data_ptr(), rows, cols, torch.get_num_threads(),
    )  # fmt: skip
    return total, out


def rope_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate, in place, the first ``num_heads`` heads of each row of ``x`` (N, >= num_heads * head_dim);
    cos/sin (N, head_dim) contiguous (a trailing unit axis is fine)."""
    rows = x.shape[0]
    assert x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous() and head_dim % 2 == 0
    assert cos.dtype == x.dtype == sin.dtype and cos.numel() == rows * head_dim and head_dim <= 1024
    _fn("rope", x.dtype)(
        x.data_ptr(), x.stride(0), rows, num_heads, head_dim, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads()
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up (N, 2I) = [gate | up] -> (N, I)."""
    rows, width = gate_up.shape
    assert gate_up.is_contiguous() and width % 2 == 0
    out = gate_up.new_empty(rows, width // 2)
    _fn("silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``, same indices (first maximum, NaN above all, -0 == +0), for CPU bf16/fp32 ``x``
    whose last axis is contiguous. torch's CPU argmax runs at ~2.4 G elements/s on fp32 and ~0.5 on bf16:
    0.65 and 2.8 ms for the LM head's (32, 49152) logits, where this takes ~0.1 ms (read-bound)."""
    if not (fusable(x) and x.dim() >= 1 and x.shape[-1] > 0 and x.stride(-1) == 1):
        return x.argmax(dim=-1)
    flat = x.reshape(-1, x.shape[-1])  # a view where the rows are evenly strided, else a copy
    out = torch.empty(flat.shape[0], dtype=torch.long)
    if flat.shape[0]:
        _fn("argmax_rows", x.dtype)(
            flat.data_ptr(), flat.shape[0], flat.shape[1], flat.stride(0), out.data_ptr(), torch.get_num_threads()
        )
    return out.reshape(x.shape[:-1])
