"""Builds of the CPU kernels against each other, in one process: compile-time switches (``NAME=VALUE`` defines,
the ``#ifndef`` knobs in ``nxdserve/csrc``) timed call by call on the same model, so the machine's drift hits every
build alike. Timing each build in its own process swung 15% between runs on the 2-vCPU EPYC these notes were
taken on; interleaved here, two identical builds agreed within 1%.

The workload is a decode step's compute for the default model served from its Q4_1 blocks (``--weights bf16``:
its fp32 expansion kept in bf16): the fused quantized forward (``csrc/qdecode.c``) at ``--rows`` decode rows at
position ``--context``, then the LM head (its Q8_0 blocks, or bf16). Prints the median ms per step of each build,
its ratio to the first (the baseline) and the largest difference of its logits from the baseline's (builds that
reorder sums differ by fp32 rounding), and writes JSON.

    PYTHONPATH=$PWD python benchmarks/kernel_ab.py --builds base QPF=1024 Q_SHRINK=0,Q_MIN_ITEMS=16 [--rows 1]
        [--context 64] [--repeat 250] [--cpu-isa auto] [--weights gguf|bf16] [--int8-activations] [--busy 0.1]
        [--json out.json]

A build is ``base`` (no defines) or a comma-separated list of ``NAME[=VALUE]`` defines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from nxdserve.cpu_options import CpuOptions, set_openmp_wait_policy

set_openmp_wait_policy()  # before torch loads OpenMP, which reads it once

import numpy as np  # noqa: E402 - after the wait policy
import torch  # noqa: E402 - after the wait policy

from nxdserve.engine.models import cpu_kernels, cpu_setup, quant  # noqa: E402 - after the wait policy
from nxdserve.engine.models.attention import AttentionMetadata  # noqa: E402 - after the wait policy
from nxdserve.engine.models.llama import LlamaFamilyModel  # noqa: E402 - after the wait policy


def defines(build: str) -> list[str]:
    """``base`` -> no flags; ``A=1,B`` -> ``-DA=1 -DB``."""
    if build == "base":
        return []
    names = [part.strip() for part in build.split(",") if part.strip()]
    if not names or any(not name.split("=")[0].isidentifier() for name in names):
        raise SystemExit(f"--builds: {build!r} is not 'base' or NAME[=VALUE],...")
    return [f"-D{name}" for name in names]


def _busy(share: float) -> None:
    """Spin for ``share`` of every 10 ms and sleep the rest: a third runnable thread beside the kernels' team."""
    while True:
        end = time.perf_counter() + 0.01 * share
        while time.perf_counter() < end:
            pass
        if share < 1.0:
            time.sleep(0.01 * (1.0 - share))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--builds", nargs="+", default=["base"], help="defines per build; the first is the baseline")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", type=int, default=64, help="each row's position (its slot's cached tokens)")
    ap.add_argument("--repeat", type=int, default=250, help="timed steps per build")
    ap.add_argument("--cpu-isa", default="auto")
    ap.add_argument("--int8-activations", action="store_true", help="as --cpu-quant-int8-activations")
    ap.add_argument("--weights", choices=["gguf", "bf16"], default="gguf",
                    help="gguf: the file's own Q4_1 / Q8_0 blocks; bf16: its fp32 expansion kept in bf16 (what "
                    "--dtype auto serves of a dense checkpoint on a CPU without native bf16)")
    ap.add_argument("--busy", type=float, default=0.0,
                    help="a Python thread busy this share of each 10 ms (a server's event loop, say) meanwhile")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.busy > 0:
        threading.Thread(target=_busy, args=(min(args.busy, 1.0),), daemon=True).start()
    from nxdserve.model_files import default_gguf_path, resolve_model

    path = cpu_setup.apply(CpuOptions(isa=args.cpu_isa, quant_int8_activations=args.int8_activations))
    libs = [cpu_kernels.build_running_variant(defines(build)) for build in args.builds]
    max_len = args.context + 8
    model = LlamaFamilyModel.from_pretrained(resolve_model(None), torch.float32, torch.device("cpu"), max_len)
    if args.weights == "gguf":
        quant.quantize_model(model, "gguf", default_gguf_path())
    else:
        model.quantize_linears(lambda _name, weight: quant.store_bf16(weight))
    s = model.spec
    cache = model.new_kv_cache(args.rows, max_len)
    cache.data.normal_()
    meta = AttentionMetadata.build(
        np.arange(args.rows), np.full(args.rows, args.context), np.ones(args.rows, dtype=np.int64),
        num_query_groups=s.num_heads // s.num_kv_heads, windows=model.windows, max_len=max_len,
        device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    tokens = torch.randint(0, model.vocab_size, (args.rows,))
    times: list[list[float]] = [[] for _ in libs]
    logits: list[torch.Tensor] = []
    warmup = 2 * len(libs)
    with torch.inference_mode():
        for i in range(len(libs) * args.repeat + warmup):
            b = i % len(libs)
            with cpu_kernels.running_library(libs[b]):
                # Every step writes the same K/V at the same position: each build sees the same inputs.
                assert model.fused_quant_decode.accepts(tokens, meta, cache), "the fused forward does not apply"
                t0 = time.perf_counter()
                out = model.compute_logits(model(tokens, meta, cache))
                elapsed = time.perf_counter() - t0
            if i < len(libs):
                logits.append(out)
            if i >= warmup:
                times[b].append(elapsed)
    base = statistics.median(times[0])
    results = []
    activations = "int8" if args.int8_activations else "fp32"
    busy = f", a thread busy {args.busy:.0%} of the time beside them" if args.busy > 0 else ""
    print(f"{path}, {torch.get_num_threads()} threads{busy}, {args.rows} row(s) at position {args.context}, "
          f"{args.weights} weights, {activations} activations, median of {args.repeat} steps per build, "
          "interleaved")  # fmt: skip
    for build, t, out in zip(args.builds, times, logits, strict=True):
        ms = statistics.median(t)
        diff = float((out - logits[0]).abs().max())
        results.append({"build": build, "step_ms": 1e3 * ms, "ratio": ms / base, "max_logit_diff": diff})
        print(f"  {build:32s} {1e3 * ms:7.2f} ms  {ms / base:6.3f}x  logits max diff {diff:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"path": path, "rows": args.rows, "context": args.context, "activations": activations,
                       "weights": args.weights, "busy": args.busy, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
