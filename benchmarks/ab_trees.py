"""Two source trees of nxdserve (say, a worktree at the commit before a refactor and this checkout), the same
engine workloads, interleaved: proof that a change did not slow the engine (issue 26, item 9).

Each round runs every tree once in its own process (its tree first on sys.path), in alternating order, with:
- a: 32 concurrent requests, ~70-token prompts, 64 output tokens each (output tok/s and mean TTFT);
- b: one stream, a 32-token prompt, 128 output tokens (output tok/s).
Prints per-round figures and the median of the rounds' own ratios (tree B over tree A), and writes JSON.
With ``--control`` tree A also runs a second time in each round (A'), and A'/A per round is the noise band that
B/A is judged against: on a shared 2-core VM a single process can run 30% slower than the next.

    .venv/bin/python benchmarks/ab_trees.py --tree-a /path/to/old/checkout --tree-b . [--rounds 3] [--control]
        [--dtype auto] [--cpu-quant-int8-activations]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_WORKLOAD = r"""
import asyncio, json, time
try:
    from nxdserve.cpu_options import set_openmp_wait_policy
    set_openmp_wait_policy()
except ImportError:  # trees before the CPU options: importing nxdserve set the wait policy itself
    pass
from nxdserve import AsyncEngine, EngineConfig, SamplingParams
from nxdserve.sampling_params import OutputKind

WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars watch the quiet sea".split()

async def run(engine, prompts, max_tokens):
    ttfts, tokens = [], 0
    async def one(i, prompt):
        nonlocal tokens
        start = time.perf_counter()
        first = None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=OutputKind.DELTA)
        async for out in engine.generate(prompt, params):
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            tokens += len(out.outputs[0].token_ids)
        ttfts.append(first)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return tokens / (time.perf_counter() - t0), sum(ttfts) / len(ttfts)

async def main():
    # Dense fp32 by default (--dtype): the default model is served from its 4-bit blocks by default since
    # 2026-12-02, which trees before that cannot do.
    extra = {}
    if INT8_ACTIVATIONS:
        from nxdserve.cpu_options import CpuOptions
        extra["cpu"] = CpuOptions(quant_int8_activations=True)
    async with AsyncEngine(EngineConfig(max_num_seqs=32, dtype=DTYPE, **extra)) as engine:
        await run(engine, [" ".join(WORDS[:8])] * 4, 8)  # warm-up
        burst = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(52)) for i in range(32)]
        a_tps, a_ttft = await run(engine, burst, 64)
        b_tps, _ = await run(engine, [" ".join(WORDS * 2)[:160]], 128)
        # Where a slow run spent its time: the model's forward (summed in the worker thread) or the driver.
        timings = getattr(engine.core, "timings", None)
        forward_s = getattr(timings, "forward", float("nan"))
    print(json.dumps({"a_tok_s": a_tps, "a_mean_ttft_ms": 1000 * a_ttft, "b_tok_s": b_tps, "forward_s": forward_s}))

asyncio.run(main())
"""


def run_tree(tree: Path, dtype: str = "float32", int8_activations: bool = False) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    workload = f"DTYPE = {dtype!r}\nINT8_ACTIVATIONS = {int8_activations!r}\n" + _WORKLOAD
    proc = subprocess.run([sys.executable, "-c", workload], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=1800, check=True)  # fmt: skip
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree-a", required=True, help="the baseline checkout")
    parser.add_argument("--tree-b", default=".", help="the changed checkout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--control", action="store_true", help="run tree A twice a round (A' / A: the noise)")
    parser.add_argument("--dtype", default="float32", help="EngineConfig.dtype in both trees (auto: the default, "
                        "which serves the default model from its 4-bit blocks on CPUs without native bf16)")
    parser.add_argument("--cpu-quant-int8-activations", action="store_true",
                        help="CpuOptions.quant_int8_activations in both trees (trees from 2026-12-02 on)")
    parser.add_argument("--out", default="bench-results/ab_trees.json")
    args = parser.parse_args()
    trees = {"A": Path(args.tree_a).resolve(), "B": Path(args.tree_b).resolve()}
    names = ["A", "B", "A'"] if args.control else ["A", "B"]
    rounds = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]  # each tree in each place in turn
        got = {name: run_tree(trees[name[0]], args.dtype, args.cpu_quant_int8_activations) for name in order}
        rounds.append(got)
        figures = [f"{n}: a {g['a_tok_s']:.1f} tok/s, TTFT {g['a_mean_ttft_ms']:.0f} ms, b {g['b_tok_s']:.1f} tok/s, "
                   f"forward {g['forward_s']:.1f} s" for n, g in ((n, got[n]) for n in names)]
        print(f"round {r + 1} ({' then '.join(order)}): " + "; ".join(figures), flush=True)
    keys = ("a_tok_s", "a_mean_ttft_ms", "b_tok_s", "forward_s")
    summary = {}
    for other in names[1:]:
        per_round = {key: sorted(g[other][key] / g["A"][key] for g in rounds) for key in keys}
        summary[f"{other}/A"] = {key: {"median": statistics.median(v), "min": v[0], "max": v[-1]}
                                 for key, v in per_round.items()}  # fmt: skip
    print(f"\n{'metric':>16} | " + " | ".join(f"{pair} median (min-max of the rounds)" for pair in summary))
    for key in keys:
        cells = [f"{s[key]['median']:.3f} ({s[key]['min']:.2f}-{s[key]['max']:.2f})" for s in summary.values()]
        print(f"{key:>16} | " + " | ".join(cells))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    config = {"dtype": args.dtype, "cpu_quant_int8_activations": args.cpu_quant_int8_activations}
    Path(args.out).write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "config": config,
                                          "rounds": rounds, "ratios": summary}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
