"""The packed bf16 GEMM (``gemm_bf16``, ``csrc/gemm.c``) on the default model's projection shapes, weights cold.

A model reads every weight from DRAM once per step, so each shape cycles over 30 packed copies (3 for the LM
head) and the time is per call. ``--against OTHER.so`` interleaves another build of the kernel library (e.g.
the cached one from before a change: ``~/.cache/nxdserve/kernels/kernels-avx512bf16-<hash>.so``; builds from
before the args structs, ``slot_attention-<hash>.so``, are called the old way) and prints the
time ratio new / other, medians of ``--repeats`` interleaved rounds. On AMX machines the same copies are also
timed compressed (``gemm.compress``, read by this build) and the ratio compressed / plain is printed.
Prints a table, writes JSON.

    .venv/bin/python benchmarks/gemm_bench.py [--rows 1,8,32,96] [--against OLD.so] [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nxdserve.cpu_options import set_openmp_wait_policy

set_openmp_wait_policy()  # before torch loads OpenMP

# isort: split
import torch  # noqa: E402 - after the wait policy

from nxdserve.engine.models import cpu_kernels, gemm  # noqa: E402 - after the wait policy

# SmolLM2-135M: (out features, in features)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
_P, _I = ctypes.c_void_p, ctypes.c_int64
Gemm = Callable[[int, int, int, int, "int | None", int, int, int], None]  # x, M, K, w, cw, N, out, threads


def _struct_call(lib: Any) -> Gemm:
    def call(x: int, m: int, k: int, w: int, cw: int | None, n: int, out: int, threads: int) -> None:
        args = cpu_kernels.GemmArgs(x, m, k, k, w, cw, None, None, 0, n, out, n, threads)
        lib.gemm_bf16(ctypes.byref(args))

    return call


def _load(path: str) -> Gemm:
    if hasattr(ctypes.CDLL(path), "nxd_struct_layouts"):
        lib = cpu_kernels.load(Path(path))
        lib.gemm_amx()  # as cpu_kernels does for its own build: without it AMX stays off
        return _struct_call(lib)
    old = ctypes.CDLL(path)  # a build from before the args structs: positional arguments
    old.gemm_bf16.argtypes = [_P, _I, _I, _I, _P, _P, _P, _P, _I, _I, _P, _I, ctypes.c_int]
    old.gemm_bf16.restype = None
    if hasattr(old, "gemm_amx"):
        old.gemm_amx()

    def call(x: int, m: int, k: int, w: int, cw: int | None, n: int, out: int, threads: int) -> None:
        old.gemm_bf16(x, m, k, k, w, cw, None, None, 0, n, out, n, threads)

    return call


def _time_per_call(gemm_call: Gemm, x: torch.Tensor, copies: list[tuple[torch.Tensor, torch.Tensor | None]], n: int,
                   out: torch.Tensor, threads: int) -> float:
    m, k = x.shape
    t0 = time.perf_counter()
    for w, blob in copies:
        cw = None if blob is None else blob.data_ptr()
        gemm_call(x.data_ptr(), m, k, w.data_ptr(), cw, n, out.data_ptr(), threads)
    return (time.perf_counter() - t0) / len(copies) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32,96", help="comma list of M (tokens in the step)")
    parser.add_argument("--against", default=None, help="another build of the kernel library to interleave")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="bench-results/gemm_bench.json")
    args = parser.parse_args()
    if not gemm.available():
        raise SystemExit("the packed GEMM is not built here (needs a C compiler and AVX512-BF16)")
    torch.set_num_threads(args.threads)
    libs = {"this": _struct_call(cpu_kernels._library())}
    if args.against:
        libs["other"] = _load(args.against)
    gen = torch.Generator().manual_seed(0)
    compressed = gemm.uses_amx()  # only the tiles read compressed panels
    if compressed:
        libs["compressed"] = libs["this"]
    copies: dict[str, list[torch.Tensor]] = {}
    blobs: dict[str, list[torch.Tensor | None]] = {}
    for name, (n, k) in SHAPES.items():
        count = 3 if name == "lm_head" else 30  # the LM head alone is 56 MB: 3 copies are cold already
        weights = [(torch.randn(n, k, generator=gen) * 0.05).bfloat16() for _ in range(count)]
        copies[name] = [gemm.pack(w) for w in weights]
        blobs[name] = [gemm.compress(w) if compressed else None for w in weights]
    rows: list[dict[str, Any]] = []
    for m in (int(v) for v in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, generator=gen).bfloat16()
            out = torch.empty(m, n, dtype=torch.bfloat16)
            times: dict[str, list[float]] = {key: [] for key in libs}
            order = list(libs)
            for rep in range(args.repeats):
                for key in order if rep % 2 == 0 else order[::-1]:
                    used = blobs[name] if key == "compressed" else [None] * len(blobs[name])
                    pairs = list(zip(copies[name], used, strict=True))
                    times[key].append(_time_per_call(libs[key], x, pairs, n, out, args.threads))
            med = {key: statistics.median(v) for key, v in times.items()}
            row = {"rows": m, "shape": name, "us": med["this"], "gflops": 2 * m * n * k / med["this"] / 1e3}
            if "compressed" in med:
                row["compressed_us"] = med["compressed"]
                row["compressed_ratio"] = med["compressed"] / med["this"]
            if "other" in med:
                row["other_us"] = med["other"]
                row["ratio"] = med["this"] / med["other"]
            rows.append(row)
    header = f"{'M':>5} {'shape':>8} {'us':>9} {'GFLOP/s':>8}"
    if compressed:
        header += f" {'cw us':>9} {'cw/plain':>8}"
    print(header + (f" {'other us':>9} {'ratio':>6}" if args.against else ""))
    for r in rows:
        line = f"{r['rows']:>5} {r['shape']:>8} {r['us']:>9.1f} {r['gflops']:>8.1f}"
        if "compressed_us" in r:
            line += f" {r['compressed_us']:>9.1f} {r['compressed_ratio']:>8.2f}"
        if "ratio" in r:
            line += f" {r['other_us']:>9.1f} {r['ratio']:>6.2f}"
        print(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": args.threads, "against": args.against, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
