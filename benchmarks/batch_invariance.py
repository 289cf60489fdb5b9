"""How often does batch shape flip a greedy near-tie? (issue 2, item 9)

Runs the same prompts greedily alone (batch 1) and all together (batch N) and counts prompts whose outputs
differ, with the first diverging position. fp32 is the control (expected: identical); bf16 is what `auto`
picks on this CPU. Prints a table and writes JSON.

    .venv/bin/python benchmarks/batch_invariance.py [--tokens 64] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.helpers

from nxdserve.sampling_params import SamplingParams
from tests.helpers.engine import PROMPTS, make_core, run_to_completion, tokenize


def compare(dtype: str, tokens: int, mode: dict[str, object]) -> dict[str, object]:
    core = make_core(dtype=dtype, max_model_len=256, max_num_seqs=len(PROMPTS), **mode)
    prompts = tokenize(core, PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in run_to_completion(core, prompts, params)]
    alone = [run_to_completion(core, [p], params)[0].outputs[0].token_ids for p in prompts]
    diverge = []
    for a, b in zip(alone, batched, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        diverge.append(first)
    flipped = [d for d in diverge if d is not None]
    return {
        "dtype": dtype,
        "mode": "chunked" if mode.get("enable_chunked_prefill", True) else "prefill-first",
        "prompts": len(prompts),
        "tokens": tokens,
        "prompts_differing": len(flipped),
        "first_divergence_positions": flipped,
        "tokens_compared": len(prompts) * tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", default="bench-results/batch_invariance.json")
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes.split(","):
        for mode in ({"enable_chunked_prefill": True}, {"enable_chunked_prefill": False}):
            rows.append(compare(dtype, args.tokens, mode))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'dtype':>10} | {'mode':>14} | {'differing prompts':>18} | first divergence (token index)")
    for r in rows:
        print(f"{r['dtype']:>10} | {r['mode']:>14} | {r['prompts_differing']:>8} / {r['prompts']:<7} | "
              f"{r['first_divergence_positions']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
