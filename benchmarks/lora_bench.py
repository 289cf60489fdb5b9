"""Multi-LoRA benchmark: output speed with adapters in the batch against the base model alone, same run.

    python benchmarks/lora_bench.py                      # both workloads, the default model
    python benchmarks/lora_bench.py --max-tokens 64 --repeats 3 --out lora_bench.json
    python benchmarks/lora_bench.py --dtype float32 --quantization gguf   # LoRA over a quantized base

Workloads (greedy, ignore_eos, on the engine core):
- batch: 32 concurrent requests spread over 4 adapters and the base model (round-robin) against 32 on the
  base model alone: output tok/s (all generated tokens over the wall/CPU time of the run);
- single: one stream, requests one after another, with an adapter against the base model: output tok/s
  (prefill included, as a client sees it).
Adapters are made here with ``peft`` on the model's own weights (rank --rank, every q/k/v/o/gate/up/down
projection, seeded non-zero B); nothing is downloaded. Configurations are interleaved per repeat so
background load hits them alike; medians are reported with their ratio to the base model in the same run.
Targets (issue 28): batch ratio >= 0.8, single-stream ratio >= 0.9. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from nxdserve.config import EngineConfig
from nxdserve.engine.core import EngineCore
from nxdserve.engine.loader import build_engine_core
from nxdserve.lora.request import LoRARequest
from nxdserve.model_files import resolve_model
from nxdserve.sampling_params import OutputKind, SamplingParams

PROMPTS = [
    "Write a short story about a lighthouse keeper and a storm.",
    "Explain how a refrigerator keeps food cold.",
    "What are some tips for a first-time visitor to Rome?",
    "Give me a weekly meal plan for a vegetarian student.",
]
NUM_ADAPTERS = 4


def make_adapters(model: Path, folder: Path, rank: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(NUM_ADAPTERS):
        base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(0.02 * torch.randn(param.shape, generator=generator))
        paths.append(folder / f"adapter{i}")
        peft_model.save_pretrained(str(paths[-1]))
    return paths


Job = tuple[list[int], str | None]  # prompt tokens, adapter name (None: the base model)


def run(core: EngineCore, jobs: list[Job], max_tokens: int, concurrent: bool) -> dict[str, float]:
    """Generated tokens per wall and CPU second; one stream (requests one after another) unless concurrent."""
    tokens = 0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    batches = [jobs] if concurrent else [[job] for job in jobs]
    for batch in batches:
        for prompt, name in batch:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    output_kind=OutputKind.FINAL_ONLY)
            lora = None if name is None else core.lora.resolve(name)  # type: ignore[union-attr]
            core.add_request(core.make_request(prompt, params, lora=lora))
        while core.has_unfinished:
            for out in core.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {"tokens": tokens, "tok_s": tokens / wall, "tok_cpu_s": tokens / cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="the base model's (e.g. gguf): LoRA over it")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--single-requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="lora_bench.json")
    args = parser.parse_args()

    model = resolve_model(args.model, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model, Path(tmp), args.rank)
        # gguf quantizes from the .gguf file itself: the default model's when --model is not given.
        engine_model = None if args.model is None and args.quantization == "gguf" else str(model)
        config = EngineConfig(model=engine_model, backend="torch", dtype=args.dtype, max_model_len=512,
                              max_num_seqs=args.concurrency, enable_lora=True, max_loras=NUM_ADAPTERS,
                              max_lora_rank=args.rank, quantization=args.quantization)
        core, _ = build_engine_core(config, with_metrics=False)
        assert core.lora is not None
        names = []
        for i, path in enumerate(adapters, start=1):
            core.lora.load(LoRARequest(f"adapter{i}", i, str(path)))
            names.append(f"adapter{i}")
        prompts = [list(core.tokenizer.encode(p)) for p in PROMPTS]
        n = args.concurrency
        workloads: dict[str, dict[str, tuple[list[Job], bool]]] = {
            "batch": {
                "base": ([(prompts[i % len(prompts)], None) for i in range(n)], True),
                "lora": ([(prompts[i % len(prompts)], [None, *names][i % (NUM_ADAPTERS + 1)]) for i in range(n)],
                         True),
            },
            "single": {
                "base": ([(prompts[i % len(prompts)], None) for i in range(args.single_requests)], False),
                "lora": ([(prompts[i % len(prompts)], names[0]) for i in range(args.single_requests)], False),
            },
        }
        run(core, workloads["single"]["lora"][0][:1], 4, False)  # warm up both paths
        results: dict[str, Any] = {}
        for workload, configs in workloads.items():
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
            for _ in range(args.repeats):
                for name, (jobs, concurrent) in configs.items():
                    samples[name].append(run(core, jobs, args.max_tokens, concurrent))
            med = {name: {k: statistics.median(s[k] for s in runs) for k in ("tok_s", "tok_cpu_s")}
                   for name, runs in samples.items()}
            results[workload] = {
                "median": med,
                "ratio_wall": med["lora"]["tok_s"] / med["base"]["tok_s"],
                "ratio_cpu": med["lora"]["tok_cpu_s"] / med["base"]["tok_cpu_s"],
                "target": 0.8 if workload == "batch" else 0.9,
                "samples": samples,
            }
    print(f"{'workload':<10}{'base tok/s':>12}{'lora tok/s':>12}{'ratio':>8}{'ratio cpu':>11}{'target':>8}")
    for workload, r in results.items():
        m = r["median"]
        print(f"{workload:<10}{m['base']['tok_s']:>12.1f}{m['lora']['tok_s']:>12.1f}{r['ratio_wall']:>8.2f}"
              f"{r['ratio_cpu']:>11.2f}{r['target']:>8.2f}")
    meta = {"model": str(model), "dtype": args.dtype, "quantization": args.quantization, "rank": args.rank,
            "max_tokens": args.max_tokens, "concurrency": n, "repeats": args.repeats, "adapters": NUM_ADAPTERS}
    Path(args.out).write_text(json.dumps({"config": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
