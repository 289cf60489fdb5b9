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

Builds. ``csrc/kernels.c`` is compiled with the system C compiler (``$CC``, else ``cc``) into
``~/.cache/nxdserve/kernels``, keyed by the sources, flags, compiler version and variant, with explicit target
flags per variant (``VARIANTS``) rather than ``-march=native``, so one build serves every machine of its class:
``generic`` (the x86-64 / armv8-a baseline), ``avx2`` (x86-64-v3: AVX2, FMA, F16C), ``avx512bf16`` (x86-64-v4
plus AVX512-BF16/VNNI and the AMX code, which runs only where the CPU has AMX and the OS grants it) and ``neon``
(armv8.2-a with fp16 and dot product). At run time the best variant the CPU's flags allow is loaded
(``configure``; ``CpuOptions.isa`` can force a lower one or ``none``). OpenMP resolves to the runtime torch
already loaded (same soname), so the kernels share torch's threads and ``OMP_WAIT_POLICY``. The long calls pass
one args struct (``nxdserve_kernels.h``), declared again below as ``ctypes.Structure``; a build whose struct
layouts differ from these is refused. Without a compiler, or with ``isa="none"``, ``available()`` is False and
the model runs its torch ops and SDPA.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from nxdserve.errors import ConfigError

logger = logging.getLogger(__name__)

MAX_GROUP = 16  # query heads per KV head
MAX_HEAD_DIM = 256

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCE = "kernels.c"  # includes the other parts: one translation unit (see its comment)

# Target flags per variant: the ISA explicit (a build runs on every CPU that has it), the tuning for the CPU that
# builds it (-mtune=native: the cache is per machine, and the CPU model is part of its key). Under -mtune=generic
# GCC vectorised the attention's softmax tail differently, so bf16 results moved by an ulp in rare rows (greedy
# bf16 text changed on a Zen 3 EPYC); tuned natively, the bits there are the old -march=native build's again.
# avx512bf16: x86-64-v4 (AVX512F/BW/CD/DQ/VL) plus the extensions the kernels test for (AVX512-BF16 and -VNNI,
# AMX-TILE/BF16/INT8), rather than -march=sapphirerapids: that would also allow AVX512-FP16 and AVX-VNNI, which
# AVX512-BF16 EPYCs (Zen 4) lack, and the kernels use neither. Every #if in the sources takes the branch it took
# under -march=native on those machines; the AMX code is compiled in for all of them and runs only where
# gemm_amx() finds the tiles and the OS permission (before, Zen 4 builds left it out).
# generic and avx2 add -fno-tree-loop-distribute-patterns: GCC turns the attention's fp32 row-copy loops into
# memcpy, which some tunings (generic) expand into 16-byte moves that the 32-byte loads right after cannot forward
# from (1.44x the attention's time on a Zen 3 EPYC); as loops they vectorise at the loads' width (0.65-0.74x of
# the -march=native build's time there). (The avx512bf16 build keeps GCC's default, as its machines built it.)
_PLAIN_LOOPS = "-fno-tree-loop-distribute-patterns"
VARIANTS: dict[str, dict[str, list[str]]] = {
    "x86_64": {
        "generic": ["-march=x86-64", "-mtune=native", _PLAIN_LOOPS],
        "avx2": ["-march=x86-64-v3", "-mtune=native", _PLAIN_LOOPS],
        "avx512bf16": [
            "-march=x86-64-v4",
            "-mavx512bf16",
            "-mavx512vnni",
            "-mamx-tile",
            "-mamx-bf16",
            "-mamx-int8",
            "-mtune=native",
        ],
    },
    "aarch64": {
        "generic": ["-march=armv8-a", "-mtune=native"],
        "neon": ["-march=armv8.2-a+fp16+dotprod", "-mtune=native"],
    },
}
# The /proc/cpuinfo flags each variant needs (x86-64-v3's are AVX2's set; abm is LZCNT).
_NEEDS: dict[str, frozenset[str]] = {
    "generic": frozenset(),
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}),
    "neon": frozenset({"asimd", "asimdhp", "asimddp"}),
}
_NEEDS["avx512bf16"] = _NEEDS["avx2"] | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16"}
_NEEDS["avx512bf16"] |= {"avx512_vnni"}
_AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})

# -ffast-math lets GCC vectorise exp (libmvec) and the fp32 sums; no inf/NaN reach the kernels' own
# arithmetic. It is given when compiling only: linked with it, GCC < 13 adds crtfastmath.o, whose
# constructor would switch the whole process to flush-denormals-to-zero when the library loads.
COMPILE_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11", "-Wall", "-Wextra", "-Werror"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]


def machine() -> str:
    arch = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``flags`` on x86, ``Features`` on aarch64), empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def runnable_paths(flags: frozenset[str] | None = None, arch: str | None = None) -> list[str]:
    """The kernel paths this CPU can run, best first, "none" last: a variant name, or "amx" (the avx512bf16
    build with the tiles, where the CPU has them; the OS permission is checked when the library loads)."""
    if arch is None and platform.system() != "Linux":  # the kernels use Linux's affinity calls
        return ["none"]
    flags = cpu_flags() if flags is None else flags
    variants = VARIANTS.get(arch or machine(), {})
    paths = [v for v in reversed(list(variants)) if _NEEDS[v] <= flags]
    if "avx512bf16" in paths and _AMX_FLAGS.issubset(flags):
        paths.insert(paths.index("avx512bf16"), "amx")
    return [*paths, "none"]


def variant_of(path: str) -> str | None:
    return None if path == "none" else "avx512bf16" if path == "amx" else path


def compiler() -> list[str] | None:
    """The C compiler command (``$CC``, else ``cc`` / ``gcc``), None when there is none."""
    cc = os.environ.get("CC")
    if cc:
        cmd = shlex.split(cc)
        return cmd if cmd and shutil.which(cmd[0]) else None
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _cpu_model() -> str:
    """What -mtune=native tunes for, as a cache key: the CPU's model line."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((ln for ln in lines if ln.startswith(("model name", "CPU part"))), "")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nxdserve" / "kernels"


def _sources() -> list[Path]:
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".h"))


def target_flags(variant: str, arch: str | None = None) -> list[str]:
    """The compiler flags of ``variant`` for ``arch`` (default: this machine's). For another architecture (a
    cross compiler) without ``-mtune=native``: there is no native CPU of that kind to tune for."""
    target = arch or machine()
    flags = VARIANTS.get(target, {}).get(variant)
    if flags is None:
        raise ValueError(f"unknown kernel variant {variant!r} for {target}")
    return flags if target == machine() else [f for f in flags if f != "-mtune=native"]


def build_variant(
    variant: str,
    cc: Sequence[str] | None = None,
    extra_flags: Sequence[str] = (),
    cache_dir: Path | None = None,
    arch: str | None = None,
) -> Path:
    """Compile ``variant`` (a key of ``VARIANTS[arch]``, this machine's by default; another ``arch`` needs its
    cross compiler as ``cc``) into the cache, or find it there; the path of the shared library. Raises
    RuntimeError with the compiler's message on failure. ``extra_flags`` go to both steps (sanitizers)."""
    cc = list(cc or compiler() or [])
    if not cc:
        raise RuntimeError("no C compiler")
    flags = target_flags(variant, arch)
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    compile_flags = [*COMPILE_FLAGS, *flags, *extra_flags]
    link_flags = [*LINK_FLAGS, *extra_flags]
    digest = hashlib.sha256()
    for part in [variant, " ".join(compile_flags), " ".join(link_flags), " ".join(cc), version, _cpu_model()]:
        digest.update(part.encode() + b"\0")
    for src in _sources():
        digest.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    target = (cache_dir or _cache_dir()) / f"kernels-{variant}-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, out = Path(tmp) / "kernels.o", Path(tmp) / target.name
        for cmd in (
            [*cc, *compile_flags, "-I", str(CSRC), "-c", str(CSRC / SOURCE), "-o", str(obj)],
            [*cc, str(obj), "-o", str(out), *link_flags],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cc)} failed for variant {variant}: {proc.stderr.strip()[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builds race harmlessly
    return target


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
        *_fields("kv_scales", _p), ("eps", _f32), ("nthreads", _i32), ("int8_activations", _i32), ("kv_fp8", _i32),
    ]  # fmt: skip


QDECODE_LAYER_POINTERS = 20  # nxdserve_kernels.h

STRUCTS: dict[str, type[ctypes.Structure]] = {
    "nxd_attention_args": AttentionArgs,
    "nxd_qgemm_args": QgemmArgs,
    "nxd_qdecode_args": QdecodeArgs,
    "nxd_gemm_args": GemmArgs,
    "nxd_decode_args": DecodeArgs,
    "nxd_greedy_head_args": GreedyHeadArgs,
}
# (LoraArgs, appended below with its wrapper, registers itself here and in _SIGNATURES.)


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
    variant = variant_of(_state.path or configure(_state.isa, _state.amx))
    if variant is None:
        raise RuntimeError("no C kernels run on this path")
    return load(build_variant(variant, extra_flags=[*_state.extra_flags, *extra_flags]))


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
    runnable = runnable_paths()
    if isa == "auto":
        path = runnable[0] if amx or runnable[0] != "amx" else runnable[1]
    elif isa in runnable:
        path = isa
    else:
        raise ConfigError(f"cpu isa {isa!r} cannot run on this CPU ({machine()}); it can run: {', '.join(runnable)}.")
    if path != "none" and compiler() is None:
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
    variant = variant_of(path)
    if variant is None:
        return None
    if variant not in _state.libs:
        try:
            _state.libs[variant] = load(build_variant(variant, extra_flags=_state.extra_flags))
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


# -- quantized-weight GEMM for a few rows (csrc/qgemm.c) ------------------------------------------------------------
QGEMM_FORMATS = {"q4": 0, "q8": 1, "fp8": 2, "bf16": 3}
QGEMM_BLOCK = 32


class QgemmWeight:
    """A quantized weight as ``qgemm_f32`` reads it (``csrc/qgemm.c``), with its args struct filled once: a call
    sets only the activations' fields on a copy (a decode step makes ~120 of these calls; each costs ~6 us of Python).

    ``fmt`` "q4": codes uint8 (N, K/2) in GGUF's nibble order, scale and offset fp32 (N, K/32); "q8": codes int8
    (N, K), scale (N, K/32); "fp8": codes float8_e4m3fn / uint8 (N, K), scale (N, K/32); "bf16": the weight in
    bfloat16 (N, K), no scale. K a multiple of 32."""

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None, fmt: str
    ) -> None:
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
        csrc/qgemm_i8.c; q4 and q8, fp8 stays exact). Callers check ``available()``."""
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
        lib = _library()
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
        lib = _library()
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


class LoraArgs(ctypes.Structure):
    _fields_ = [
        *_fields("x", _p), *_fields("M K xs", _i64), *_fields("idx a b scale ranks starts", _p),
        *_fields("S rmax N", _i64), *_fields("out", _p), *_fields("os", _i64), ("nthreads", _i32),
    ]  # fmt: skip
    keep: tuple[torch.Tensor | None, ...]  # the tensors the pointers point into, alive as long as the args
    dtype: torch.dtype  # theirs: x and out must have it


STRUCTS["nxd_lora_args"] = LoraArgs
_SIGNATURES["lora_add"] = ([ctypes.POINTER(LoraArgs)], None)


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
    lib = _library()
    assert lib is not None and x.stride(1) == 1 and out.stride(1) == 1
    if x.dtype != args.dtype or out.dtype != args.dtype:
        raise TypeError(f"lora_add: x {x.dtype} and out {out.dtype} must be the adapters' {args.dtype}")
    args.x, args.M, args.xs = x.data_ptr(), x.shape[0], x.stride(0)
    args.idx, args.out, args.os = idx.data_ptr(), out.data_ptr(), out.stride(0)
    args.nthreads = torch.get_num_threads()
    (lib.lora_add_bf16 if x.dtype == torch.bfloat16 else lib.lora_add_f32)(ctypes.byref(args))


# -- the quantizers' scale searches at load (csrc/qsearch.c) ------------------------------------------------------


class QsearchArgs(ctypes.Structure):
    _fields_ = [
        *_fields("w", _p), *_fields("N K group", _i64), *_fields("cand", _p), *_fields("ncand", _i64),
        *_fields("importance scale offset", _p), ("kind", _i32), ("nthreads", _i32),
    ]  # fmt: skip


STRUCTS["nxd_qsearch_args"] = QsearchArgs
QSEARCH_KINDS = {"int4": 0, "fp8": 1}


def quant_search(
    weight: torch.Tensor, group: int, candidates: Sequence[float], kind: str, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``quant.py``'s scale search per group of ``group`` columns of ``weight`` (N, K) fp32, K a multiple of
    ``group``: int4 (group <= 128; ``candidates`` the steps' 15 + d) -> (scale, offset), fp8 (``candidates`` the
    multipliers of absmax / 448) -> (scale, None); each (N, K / group) fp32. ``importance`` (K,) > 0: int4's squared
    errors weighted per input column. Callers check ``available()``."""
    lib = _library()
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


class GptqArgs(ctypes.Structure):
    _fields_ = [
        *_fields("w", _p), *_fields("N K group", _i64), *_fields("u cand", _p), *_fields("ncand", _i64),
        *_fields("codes scale offset", _p), ("nthreads", _i32),
    ]  # fmt: skip


STRUCTS["nxd_gptq_args"] = GptqArgs


def gptq_int4(
    weight: torch.Tensor, upper: torch.Tensor, group: int, candidates: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's column loop (``gptq.py``) on ``weight`` (N, K) fp32 with ``upper`` (K, K) fp32, the upper Cholesky
    factor of the damped H^-1, K a multiple of ``group`` (<= 128): (codes uint8 (N, K), scale, offset (N, K /
    group)). ``weight`` is not changed (the loop updates a copy). Callers check ``available()``."""
    lib = _library()
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
