"""What rounding the activations to int8 (``--cpu-quant-int8-activations``, csrc/qgemm_i8.c) costs the default model.

1. Perplexity over the shipped sample (``benchmarks/data/ppl_sample.txt``) of the default model as served (its GGUF
   4-bit blocks, Q8_0 head) with every row on the small-row kernel (``quant_dense_rows`` 0, so the prefill takes
   the kernel a decode step takes; each row is rounded alone, so the figures are a decode's): fp32 activations
   (exact) and int8 activations, against the dense bf16 model's (issue 29's reference), with the teacher-forced
   top-1 agreement between the two.
2. The engine's greedy output for ``tests/helpers/engine.PROMPTS`` with the switch off and on: identical
   completions, and the share of tokens before the first difference.

Prints a table and writes JSON.

    PYTHONPATH=$PWD python benchmarks/qgemm_i8_accuracy.py [--tokens 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.models import cpu_setup, quant
from nxdserve.engine.models.perplexity import (
    default_model,
    format_logits,
    next_token_logits,
    perplexity,
    sample_token_ids,
    top1_agreement,
)
from nxdserve.sampling_params import SamplingParams
from tests.helpers.engine import PROMPTS, make_core, run_to_completion, tokenize


def kernel_logits(ids: list[int]) -> dict[str, torch.Tensor]:
    """The default model's logits with every row on the kernel, fp32 ("exact") and int8 ("int8") activations.
    Where the build keeps larger calls on fp32 activations (``quant.int8_activation_rows``), the text runs in
    prefill chunks just under that limit, so that every call is one int8 activations serve."""
    model = default_model("gguf")
    out = {}
    for name, int8 in (("exact", False), ("int8", True)):
        cpu_setup.apply(CpuOptions(quant_dense_rows=0, quant_int8_activations=int8))
        assert quant.int8_activations == int8
        limit = quant.int8_activation_rows()
        out[name] = next_token_logits(model, ids, chunk=limit - 1 if limit else 0)
    cpu_setup.apply(CpuOptions())
    return out


def greedy(tokens: int, int8: bool) -> list[list[int]]:
    core = make_core(dtype="auto", cpu=CpuOptions(quant_int8_activations=int8))
    prompts = tokenize(core, PROMPTS)
    outs = run_to_completion(core, prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ids = sample_token_ids()
    start = time.perf_counter()
    logits = kernel_logits(ids)
    logits["bf16"] = format_logits("bf16", ids)
    ppl = {name: perplexity(t, ids) for name, t in logits.items()}
    result: dict[str, object] = {
        "tokens": len(ids),
        "perplexity": ppl,
        "int8_vs_exact": ppl["int8"] / ppl["exact"] - 1,
        "exact_vs_bf16": ppl["exact"] / ppl["bf16"] - 1,
        "int8_vs_bf16": ppl["int8"] / ppl["bf16"] - 1,
        "top1_int8_vs_exact": top1_agreement(logits["int8"], logits["exact"]),
        "perplexity_seconds": time.perf_counter() - start,
    }
    print(f"perplexity over {len(ids)} tokens: bf16 {ppl['bf16']:.4f}, gguf exact {ppl['exact']:.4f} "
          f"({100 * result['exact_vs_bf16']:+.2f}% vs bf16), gguf int8 activations {ppl['int8']:.4f} "  # type: ignore[operator]
          f"({100 * result['int8_vs_exact']:+.2f}% vs exact, {100 * result['int8_vs_bf16']:+.2f}% vs bf16); "  # type: ignore[operator]
          f"teacher-forced top-1 agreement int8 / exact {result['top1_int8_vs_exact']:.3f}", flush=True)
    exact, int8 = greedy(args.tokens, False), greedy(args.tokens, True)
    same = sum(a == b for a, b in zip(exact, int8, strict=True))
    prefix = sum(common_prefix(a, b) for a, b in zip(exact, int8, strict=True)) / sum(len(a) for a in exact)
    result.update({"greedy_prompts": len(exact), "greedy_identical": same, "greedy_prefix_share": prefix,
                   "greedy_tokens": args.tokens})
    print(f"engine greedy, {len(exact)} prompts x {args.tokens} tokens: {same} identical completions; "
          f"{100 * prefix:.1f}% of tokens before the first difference")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
