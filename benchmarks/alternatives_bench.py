"""Verification steps with draft alternatives (EAGLE's tree verification: k drafts plus, by default, 2 alternatives
to the first draft per row; alternatives ride while at most 4 rows decode) on the torch backend at long contexts:
the fused forward against the layer path (``--no-cpu-fused-decode`` / ``--no-cpu-fused-quant-decode``, where every
such step went before), and the fused step without alternatives, per ``--kv-cache-dtype``, interleaved in one
process. Prints a table (median ms a step, ratio to the layer path) and writes JSON.

    PYTHONPATH=$PWD python benchmarks/alternatives_bench.py --dtype bfloat16               # decode.c
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        PYTHONPATH=$PWD python benchmarks/alternatives_bench.py --cpu-isa avx2                # qdecode.c, Q4_1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from nxdserve.cpu_options import set_openmp_wait_policy

set_openmp_wait_policy()  # before torch loads OpenMP, which reads it once

# isort: split
import numpy as np  # noqa: E402 - after the wait policy
import torch  # noqa: E402 - after the wait policy

from nxdserve import EngineConfig  # noqa: E402 - after the wait policy
from nxdserve.cpu_options import CpuOptions  # noqa: E402 - after the wait policy
from nxdserve.engine.loader import build_engine_core  # noqa: E402 - after the wait policy
from nxdserve.engine.models import fused_decode, fused_qdecode  # noqa: E402 - after the wait policy
from nxdserve.engine.models.attention import DraftAlternatives  # noqa: E402 - after the wait policy

KINDS = ("fused", "layers", "fused, no alternatives")


def time_steps(args: argparse.Namespace, kv_dtype: str, rows: int) -> dict[str, float]:
    """Median seconds of one verification step per kind: ``rows`` slots prefilled to ``--context`` tokens, each
    verifying 1 + k tokens plus ``--alternatives`` alternatives at its first draft position."""
    config = EngineConfig(model=args.model, backend="torch", device="cpu", dtype=args.dtype, kv_cache_dtype=kv_dtype,
                          max_model_len=args.context + args.k + 8, max_num_seqs=rows, enable_chunked_prefill=False,
                          cpu=CpuOptions(isa=args.cpu_isa))  # fmt: skip
    core, _ = build_engine_core(config, with_metrics=False)
    runner = core.backend.runner  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model.vocab_size
    slots, starts = np.arange(rows), np.full(rows, args.context)
    lens = np.full(rows, 1 + args.k)
    row_tokens = rows * (1 + args.k)
    tokens = torch.randint(0, vocab, (row_tokens + rows * args.alternatives,), generator=gen)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    saved = fused_decode.enabled, fused_qdecode.enabled
    try:
        with torch.inference_mode():
            for slot in range(rows):
                prompt = torch.randint(0, vocab, (args.context,), generator=gen)
                runner.run(prompt, np.array([slot]), np.array([0]), np.array([args.context]))
            for _ in range(args.repeats + 1):  # the first round warms up
                for kind in KINDS:
                    fused_decode.enabled = fused_qdecode.enabled = kind != "layers"
                    alts = None
                    if kind != "fused, no alternatives":
                        positions = torch.full((rows * args.alternatives,), args.context + 1)
                        alts = DraftAlternatives(torch.tensor(np.repeat(slots, args.alternatives)), positions)
                    n = row_tokens if alts is None else tokens.numel()
                    t0 = time.perf_counter()
                    runner.run(tokens[:n], slots, starts, lens, alts=alts)
                    times[kind].append(time.perf_counter() - t0)
    finally:
        fused_decode.enabled, fused_qdecode.enabled = saved
    model_dtype = str(runner.model.dtype)
    del core, runner
    return {"model_dtype": model_dtype, **{kind: statistics.median(ts[1:]) for kind, ts in times.items()}}  # type: ignore[dict-item]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cpu-isa", default="auto", help="the C kernels' build (--cpu-isa); for avx2 set "
                    "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 too")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--context", type=int, default=1000, help="tokens in each slot before the step")
    ap.add_argument("--k", type=int, default=3, help="drafts per row")
    ap.add_argument("--alternatives", type=int, default=2, help="alternatives to each row's first draft")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = []
    print(f"--dtype {args.dtype} --cpu-isa {args.cpu_isa}, {args.context} tokens in, {args.k} drafts + "
          f"{args.alternatives} alternatives a row; median ms a step (ratio: layer path / fused)")
    for kv_dtype in args.kv_cache_dtypes:
        for rows in args.rows:
            r = {"kv_cache_dtype": kv_dtype, "rows": rows, **time_steps(args, kv_dtype, rows)}
            results.append(r)
            fused, layers, plain = (float(r[kind]) for kind in KINDS)  # type: ignore[arg-type]
            print(f"KV {kv_dtype:<5} rows {rows}  fused {1e3 * fused:7.1f}  layer path {1e3 * layers:7.1f}  "
                  f"({layers / fused:4.1f}x)  fused without alternatives {1e3 * plain:7.1f}  ({r['model_dtype']})",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
