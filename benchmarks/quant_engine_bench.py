"""Engine decode speed per weight format (issue 29): the default model through the torch backend, single
stream and N concurrent, for dense fp32 / bf16 and each ``--quantization``, in the same run. Prints a table
(tok/s and the ratio to the first configuration) and writes JSON.

    PYTHONPATH=$PWD python benchmarks/quant_engine_bench.py [--batches 1 32] [--tokens 48] [--cpu-isa auto]
"""

from __future__ import annotations

import argparse
import json

from nxdserve.cpu_options import CpuOptions, set_openmp_wait_policy

set_openmp_wait_policy()  # before torch loads OpenMP, which reads it once

# isort: split
from benchmarks.engine_bench import bench_engine_decode  # noqa: E402 - after the wait policy
from nxdserve import EngineConfig  # noqa: E402 - after the wait policy
from nxdserve.engine.loader import build_engine_core  # noqa: E402 - after the wait policy

# ("auto", None) is the default configuration: no --dtype, no --quantization (the default model's own 4-bit
# blocks, except where the fused AVX512-BF16 / AMX decoder keeps dense bf16: engine/backends/weight_format.py).
CONFIGS = [("float32", None), ("auto", None), ("bfloat16", None), ("float32", "gguf"), ("float32", "int8"),
           ("float32", "int4"), ("float32", "fp8")]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--cpu-isa", default="auto", help="force a kernel path (avx2, generic, none, ...)")
    ap.add_argument("--configs", nargs="+", default=None,
                    help="a subset as dtype/method, e.g. float32/dense auto/dense float32/gguf (the first is the base)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    configs = CONFIGS if args.configs is None else [
        (dtype, None if method == "dense" else method) for dtype, method in (c.split("/") for c in args.configs)
    ]  # fmt: skip
    rows: list[dict[str, object]] = []
    for dtype, method in configs:
        config = EngineConfig(model=None, backend="torch", device="cpu", dtype=dtype, quantization=method,
                              max_model_len=256, max_num_seqs=max(args.batches), cpu=CpuOptions(isa=args.cpu_isa))
        core, _ = build_engine_core(config, with_metrics=False)
        for batch in args.batches:
            result = bench_engine_decode(core, batch, args.tokens)
            rows.append({"dtype": dtype, "quantization": method, "served": config.quantization or "dense",
                         "batch": batch, **result})
        del core
    print(f"--cpu-isa {args.cpu_isa}; decode tok/s (ratio to the first configuration at the same batch)")
    for batch in args.batches:
        base = next(float(r["tok_s"]) for r in rows if r["batch"] == batch)  # type: ignore[arg-type]
        for r in rows:
            if r["batch"] == batch:
                tok_s = float(r["tok_s"])  # type: ignore[arg-type]
                label = f"{r['dtype']} {r['quantization'] or 'dense'}" + (" -> " + str(r["served"])
                                                                           if r["dtype"] == "auto" else "")
                print(f"batch {batch:>3}  {label:<22} {tok_s:8.1f} tok/s  {tok_s / base:5.2f}x  "
                      f"step {float(r['step_ms']):6.1f} ms")  # type: ignore[arg-type]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
