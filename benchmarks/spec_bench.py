"""Speculative decoding benchmark: decode speed with and without each method, on the engine core.

    python benchmarks/spec_bench.py --eagle DIR                 # plain, ngram, eagle; all workloads
    python benchmarks/spec_bench.py --methods plain,ngram --batch-sizes 1 --workloads grounded
    python benchmarks/spec_bench.py --bf16-ties                 # how often bf16 near-ties flip a token

Workloads (chat template applied, greedy, the default model unless --model):
- grounded: the answer copies a given text (repeat it, fix its typos, put it in a list), where n-gram
  lookup finds most of the next tokens in the prompt;
- chat: free-form questions (none of them in train-eagle's prompt set).
Batch sizes: 1 (single stream, requests one after another) and B concurrent requests. Speed is decode
speed: tokens after each request's first token divided by the time after the first token (prefill
excluded, identical across methods anyway), per wall-clock second and per CPU second of this
process (on a shared machine other processes stretch wall time at random; CPU time measures the
work). Each configuration runs ``--repeats`` times, methods interleaved so background load hits them
alike; medians are reported with their ratio to plain decoding in the same run. Prints a table and
writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from nxdserve.config import EngineConfig
from nxdserve.engine.core import EngineCore
from nxdserve.engine.loader import build_engine_core
from nxdserve.sampling_params import OutputKind, SamplingParams

TEXTS = [
    "The river town woke slowly. Fishermen dragged their boats onto the gravel, the baker opened his shutters, "
    "and a dog chased gulls along the quay until they settled on the roof of the old customs house. By nine the "
    "market was full of voices, crates of apples, and the smell of smoked fish.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and wait until the "
    "power light turns solid green. Then hold the reset button on the back for ten seconds with a paperclip. "
    "The lights will blink, and after two minutes the default network name appears on the label.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose "
    "and oxygen. It takes place mainly in the leaves, inside chloroplasts, which contain the pigment "
    "chlorophyll. The oxygen we breathe is a by-product of this process.",
    "Our quarterly results show revenue of 4.2 million dollars, up twelve percent from last year. Costs rose by "
    "five percent, mostly because of new hires in the support team. We expect growth to continue next quarter "
    "as the two new products reach more customers in Europe and Asia.",
]
GROUNDED_TASKS = [
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Fix any spelling mistakes in the following text and return the full corrected text:\n\n{text}",
    "Copy the following paragraph, then add one sentence at the end:\n\n{text}",
    "Rewrite the following text exactly as it is, but in a numbered list with one sentence per item:\n\n{text}",
]
CHAT = [
    "What are some tips for a first-time visitor to Rome?",
    "How do I keep basil alive indoors?",
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper and a storm.",
    "What is the difference between a comet and an asteroid?",
    "Give me a weekly meal plan for a vegetarian student.",
    "Why do cats purr?",
    "Describe how to train for a first 10k run.",
    "What should I know before adopting a dog?",
    "How do noise-cancelling headphones work?",
    "Write a polite complaint letter about a late delivery.",
    "What were the main causes of the French Revolution?",
    "How can I make my presentations more engaging?",
    "Explain the rules of volleyball.",
    "What is the healthiest way to cook vegetables?",
    "Tell me about the life cycle of a butterfly.",
]


def chat_ids(core: EngineCore, text: str) -> list[int]:
    rendered = core.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)
    return list(core.tokenizer.encode(str(rendered), add_special_tokens=False))


def workload_prompts(core: EngineCore, name: str, count: int) -> list[list[int]]:
    if name == "grounded":
        texts = [task.format(text=TEXTS[(i + j) % len(TEXTS)]) for i, task in enumerate(GROUNDED_TASKS)
                 for j in range(len(TEXTS))]
    else:
        texts = CHAT
    return [chat_ids(core, texts[i % len(texts)]) for i in range(count)]


def run_batch(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> tuple[int, float, float]:
    """Submit all prompts at once; return (tokens after each request's first, wall seconds and CPU
    seconds of this process after all firsts)."""
    first: dict[str, float] = {}
    counts: dict[str, int] = {}
    ids = []
    for prompt in prompts:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=OutputKind.DELTA)
        request = core.make_request(prompt, params)
        core.add_request(request)
        ids.append(request.request_id)
    decode_start: float | None = None
    cpu_start = 0.0
    while core.has_unfinished:
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if out.request_id not in first and n:
                first[out.request_id] = now
                n -= 1
            counts[out.request_id] = counts.get(out.request_id, 0) + n
        if decode_start is None and len(first) == len(ids):
            decode_start, cpu_start = now, time.process_time()
            counts = dict.fromkeys(counts, 0)
    end, cpu_end = time.perf_counter(), time.process_time()
    if decode_start is None:
        return 0, 0.0, 0.0
    # Tokens produced after every request had its first one (the same window for every method).
    return sum(counts.values()), end - decode_start, cpu_end - cpu_start


def measure(core: EngineCore, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, float]:
    """Decode tokens per wall second and per CPU second of this process: sequential single requests
    for batch 1, else groups of ``batch``."""
    tokens, wall, cpu = 0, 0.0, 0.0
    for i in range(0, len(prompts), batch):
        n, w, c = run_batch(core, prompts[i : i + batch], max_tokens)
        tokens, wall, cpu = tokens + n, wall + w, cpu + c
    return (tokens / wall if wall else 0.0), (tokens / cpu if cpu else 0.0)


def spec_config(method: str, args: argparse.Namespace) -> dict[str, Any] | None:
    k = args.num_speculative_tokens
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": args.ngram_k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 5}
    if method == "eagle" or method.startswith("eagle:"):
        # "eagle:K", "eagle:K+A" (A draft alternatives) or "eagle:K:DIR": compare lookaheads, alternatives or
        # heads in one interleaved run.
        _, *rest = method.split(":", 2)
        head = rest[1] if len(rest) > 1 else args.eagle
        if not head:
            raise SystemExit("--eagle DIR is required for the eagle method (train one with nxdserve train-eagle)")
        config: dict[str, Any] = {"method": "eagle", "model": head, "num_speculative_tokens": k}
        if rest:
            lookahead, _, alternatives = rest[0].partition("+")
            config["num_speculative_tokens"] = int(lookahead)
            if alternatives:
                config["draft_alternatives"] = int(alternatives)
        return config
    if method == "self-draft":
        return {"method": "draft_model", "self_draft_layers": args.self_draft_layers, "num_speculative_tokens": k}
    if method == "draft-model":
        return {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k}
    raise SystemExit(f"unknown method {method!r}")


def build(method: str, args: argparse.Namespace, max_batch: int, dtype: str | None = None) -> EngineCore:
    spec = spec_config(method, args)
    if spec is not None and args.always_draft:
        spec["disable_by_batch_size"] = 1 << 20
    # A step budget of max_model_len admits a whole batch's prompts in a step or two, so the window after
    # every first token is B requests decoding together. (With the CPU default of 96 tokens, the early
    # requests are most of the way through their answers before the last one is admitted, and the window
    # measures a shrinking batch's tail instead of batch-B decoding.)
    config = EngineConfig(model=args.model, backend="torch", dtype=dtype or args.dtype,
                          max_model_len=args.max_model_len, max_num_seqs=max_batch,
                          max_num_batched_tokens=args.max_num_batched_tokens or args.max_model_len,
                          num_threads=args.threads or None, speculative_config=spec)
    return build_engine_core(config)[0]


def bench(args: argparse.Namespace) -> dict[str, Any]:
    methods = args.methods.split(",")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    workloads = args.workloads.split(",")
    cores = {m: build(m, args, max(batches)) for m in methods}
    results: dict[str, Any] = {}
    for workload in workloads:
        for batch in batches:
            count = args.num_prompts if batch == 1 else batch * args.batches
            prompts = workload_prompts(cores[methods[0]], workload, count)
            for core in cores.values():  # warm up this shape (oneDNN primitives, the policy's first steps)
                measure(core, prompts[: max(1, min(batch, 4))], batch, 16)
            speeds: dict[str, list[float]] = {m: [] for m in methods}
            cpu_speeds: dict[str, list[float]] = {m: [] for m in methods}
            for _ in range(args.repeats):
                for m in methods:
                    wall, cpu = measure(cores[m], prompts, batch, args.max_tokens)
                    speeds[m].append(wall)
                    cpu_speeds[m].append(cpu)
            plain = statistics.median(speeds["plain"]) if "plain" in speeds else None
            plain_cpu = statistics.median(cpu_speeds["plain"]) if "plain" in speeds else None
            for m in methods:
                median, median_cpu = statistics.median(speeds[m]), statistics.median(cpu_speeds[m])
                proposer = cores[m].proposer
                row = {
                    "workload": workload, "batch": batch, "method": m, "tokens_per_s": round(median, 2),
                    "runs": [round(s, 2) for s in speeds[m]],
                    "ratio_vs_plain": round(median / plain, 3) if plain else None,
                    "tokens_per_cpu_s": round(median_cpu, 2),
                    "cpu_ratio_vs_plain": round(median_cpu / plain_cpu, 3) if plain_cpu else None,
                }
                if proposer is not None:
                    row["mean_acceptance_length"] = round(proposer.stats.mean_acceptance_length, 3)
                    row["policy"] = proposer.policy.describe()
                    alternatives = proposer.describe().get("alternatives_policy")  # EAGLE's: with vs without
                    if alternatives is not None:
                        row["alternatives_policy"] = alternatives
                    proposer.stats.__init__(proposer.k)  # per-configuration acceptance
                results[f"{workload}/b{batch}/{m}"] = row
                print(_format(row), flush=True)
    return results


def bf16_ties(args: argparse.Namespace) -> dict[str, Any]:
    """Greedy bf16 outputs with speculation vs without: how many requests differ, and where."""
    methods = [m for m in args.methods.split(",") if m != "plain"]
    plain = build("plain", args, 16, dtype="bfloat16")
    prompts = workload_prompts(plain, "chat", 16) + workload_prompts(plain, "grounded", 16)

    def outputs(core: EngineCore) -> list[list[int]]:
        out = []
        for i in range(0, len(prompts), 16):
            ids = []
            for p in prompts[i : i + 16]:
                request = core.make_request(p, SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                              output_kind=OutputKind.FINAL_ONLY))
                core.add_request(request)
                ids.append(request.request_id)
            finals = {}
            while core.has_unfinished:
                for o in core.step():
                    if o.finished:
                        finals[o.request_id] = list(o.outputs[0].token_ids)
            out += [finals[r] for r in ids]
        return out

    reference = outputs(plain)
    report: dict[str, Any] = {}
    for m in methods:
        got = outputs(build(m, args, 16, dtype="bfloat16"))
        diverged = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
                    for x, y in zip(reference, got, strict=True) if x != y]
        total = sum(len(x) for x in reference)
        report[m] = {"requests": len(prompts), "requests_differing": len(diverged), "first_divergence": diverged,
                     "tokens_compared": total}
        print(f"bf16 {m}: {len(diverged)}/{len(prompts)} requests differ from plain decoding "
              f"(first divergence at tokens {diverged})", flush=True)
    return report


def _format(row: dict[str, Any]) -> str:
    ratio = f"{row['ratio_vs_plain']:.2f}x" if row.get("ratio_vs_plain") else "-"
    cpu_ratio = f"{row['cpu_ratio_vs_plain']:.2f}x" if row.get("cpu_ratio_vs_plain") else "-"
    accept = f"  accept len {row['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in row else ""
    return (f"{row['workload']:>9} b{row['batch']:<3} {row['method']:>11}: {row['tokens_per_s']:8.2f} tok/s "
            f"{ratio:>7}  | per CPU-s {row['tokens_per_cpu_s']:8.2f} {cpu_ratio:>7}{accept}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--methods", default="plain,ngram,eagle",
                   help="comma-separated; eagle:K uses lookahead K, eagle:K+A also A draft alternatives (default 2), "
                   "eagle:K:DIR another head folder")
    p.add_argument("--workloads", default="grounded,chat")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--num-prompts", type=int, default=4, help="single-stream requests per workload")
    p.add_argument("--batches", type=int, default=1, help="groups of B concurrent requests per measurement")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="step budget (default: max_model_len)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--ngram-k", type=int, default=5, help="k for the n-gram method")
    p.add_argument("--eagle", default=None, help="EAGLE head folder")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--self-draft-layers", type=int, default=8)
    p.add_argument("--always-draft", action="store_true", help="disable the batch-size policy (draft always)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--bf16-ties", action="store_true", help="count bf16 greedy divergences instead of timing")
    p.add_argument("--out", default="bench-results/spec_bench.json")
    args = p.parse_args(argv)
    started = time.time()
    results = bf16_ties(args) if args.bf16_ties else bench(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results, "seconds": round(time.time() - started)},
                              indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
