"""Decode speed and KV memory per ``--kv-cache-dtype`` (issue 29): the default model through the torch backend,
a long prompt (default 1500 tokens) as one stream and as N concurrent streams, auto vs fp8 in the same run.
Prints a table (tok/s, ratio to auto at the same batch, prefill tok/s, KV cache MiB) and writes JSON.

    PYTHONPATH=$PWD python benchmarks/kv_bench.py [--context 1500] [--batches 1 32] [--tokens 32] [--dtype auto]
        [--kv-cache-dtypes auto fp8 fp8:layers] [--cpu-isa avx2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nxdserve.cpu_options import set_openmp_wait_policy

set_openmp_wait_policy()  # before torch loads OpenMP, which reads it once

# isort: split
from benchmarks.engine_bench import bench_engine_decode  # noqa: E402 - after the wait policy
from nxdserve import EngineConfig  # noqa: E402 - after the wait policy
from nxdserve.cpu_options import CpuOptions  # noqa: E402 - after the wait policy
from nxdserve.engine.loader import build_engine_core  # noqa: E402 - after the wait policy

SAMPLE = Path(__file__).parent / "data" / "ppl_sample.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=1500, help="prompt tokens per stream")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per stream (timed)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8"],
                    help="a value with ':layers' runs it with the fused forwards off (--no-cpu-fused-decode, "
                         "--no-cpu-fused-quant-decode)")
    ap.add_argument("--cpu-isa", default="auto", help="the C kernels' build (--cpu-isa); for avx2 set "
                    "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 too")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows: list[dict[str, object]] = []
    for label in args.kv_cache_dtypes:
        kv_dtype, _, path = label.partition(":")
        # Prefill-first, no anti-starvation break: every stream's long prompt is in before the timed decode
        # steps, so each of them runs all the streams (chunked mode would finish early streams during prefill).
        config = EngineConfig(model=None, backend="torch", device="cpu", dtype=args.dtype, kv_cache_dtype=kv_dtype,
                              max_model_len=args.context + args.tokens + 8, max_num_seqs=max(args.batches),
                              enable_chunked_prefill=False, max_consecutive_prefill_steps=1 << 30,
                              cpu=CpuOptions(isa=args.cpu_isa, fused_decode=path != "layers",
                                             fused_quant_decode=path != "layers"))
        core, _ = build_engine_core(config, with_metrics=False)
        text = SAMPLE.read_text()
        ids = list(core.tokenizer.encode(text))
        prompt = (ids * (args.context // len(ids) + 1))[: args.context]
        runner = core.backend.runner  # type: ignore[attr-defined]
        for batch in args.batches:
            result = bench_engine_decode(core, batch, args.tokens, prompt=prompt)
            rows.append({"kv_cache_dtype": label, "model_dtype": str(runner.model.dtype), "batch": batch,
                         "context": args.context, "kv_cache_mib": runner.kv_cache.nbytes / 2**20, **result})
        del core, runner
    print(f"--dtype {args.dtype}, {args.context} tokens in; decode tok/s (ratio to the first --kv-cache-dtype)")
    for batch in args.batches:
        base = next(float(r["tok_s"]) for r in rows if r["batch"] == batch)  # type: ignore[arg-type]
        for r in rows:
            if r["batch"] == batch:
                tok_s = float(r["tok_s"])  # type: ignore[arg-type]
                print(f"batch {batch:>3}  {r['kv_cache_dtype']:<12} {tok_s:8.1f} tok/s  {tok_s / base:5.2f}x  "
                      f"step {float(r['step_ms']):7.1f} ms  prefill {float(r['prefill_tok_s']):7.1f} tok/s  "  # type: ignore[arg-type]
                      f"KV cache {float(r['kv_cache_mib']):7.1f} MiB "  # type: ignore[arg-type]
                      f"({r['model_dtype']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
