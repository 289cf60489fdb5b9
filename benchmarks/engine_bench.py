"""Engine benchmark (issue 2): decode tok/s by batch size against transformers, offline throughput through
AsyncEngine, and a step-time breakdown. Prints a table and writes JSON.

    .venv/bin/python benchmarks/engine_bench.py [--batches 1,8,32,64] [--tokens 64] [--dtype auto]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from nxdserve.cpu_options import set_openmp_wait_policy

set_openmp_wait_policy()  # before torch loads OpenMP, which reads it once

# isort: split
import torch  # noqa: E402 - after the wait policy

from nxdserve import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402 - after the wait policy
from nxdserve.engine.core import EngineCore  # noqa: E402 - after the wait policy
from nxdserve.engine.loader import build_engine_core  # noqa: E402 - after the wait policy
from nxdserve.sampling_params import OutputKind  # noqa: E402 - after the wait policy

PROMPT = "Write a long story about a robot who learns to paint. Once upon a time"


def bench_engine_decode(core: EngineCore, batch: int, tokens: int, prompt: list[int] | None = None) -> dict[str, float]:
    prompt = list(core.tokenizer.encode(PROMPT)) if prompt is None else prompt
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
    for _ in range(batch):
        core.add_request(core.make_request(prompt, params))
    # Prefill (timed on its own: its tokens are not in tok_s), then the decode steps.
    t_prefill = time.perf_counter()
    while any(r.is_prefilling for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    prefill_s = time.perf_counter() - t_prefill
    before = core.timings.as_dict()
    steps = 0
    generated = 0
    t0 = time.perf_counter()
    while core.has_unfinished:
        generated += len(core.scheduler.running)
        core.step()
        steps += 1
    elapsed = time.perf_counter() - t0
    after = core.timings.as_dict()
    d = {k: after[k] - before[k] for k in after}
    step_time = elapsed / max(steps, 1)
    outside = max(0.0, elapsed - d["forward"])
    return {
        "tok_s": generated / elapsed,
        "step_ms": 1000 * step_time,
        "schedule_ms": 1000 * d["schedule"] / steps,
        "prepare_ms": 1000 * d["prepare"] / steps,
        "forward_ms": 1000 * d["forward"] / steps,
        "sample_ms": 1000 * d["sample"] / steps,
        "process_ms": 1000 * d["process"] / steps,
        "outside_forward_frac": outside / elapsed,
        "prefill_tok_s": batch * len(prompt) / prefill_s,
    }


def bench_transformers(model_path: str, dtype: torch.dtype, batch: int, tokens: int, use_generate: bool) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    # Our engine's thread governor may have left torch at one thread: the baseline gets all of them.
    torch.set_num_threads(os.cpu_count() or 1)
    ids = torch.tensor([tok.encode(PROMPT)] * batch)
    with torch.inference_mode():
        if use_generate:
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                           pad_token_id=tok.eos_token_id)
            return batch * tokens / (time.perf_counter() - t0)
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(tokens):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        return batch * tokens / (time.perf_counter() - t0)


async def bench_offline(config: EngineConfig, num_requests: int, tokens: int) -> dict[str, float]:
    async with AsyncEngine(config) as engine:
        prompts = [f"Request {i}: write something about the number {i}." for i in range(num_requests)]
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                                output_kind=OutputKind.FINAL_ONLY)

        async def one(p: str) -> int:
            n = 0
            async for out in engine.generate(p, params):
                n = out.outputs[0].cumulative_num_tokens
            return n

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - t0
    return {"requests": num_requests, "output_tokens": sum(counts), "seconds": elapsed,
            "tok_s": sum(counts) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--offline-requests", type=int, default=64)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default="bench-results/engine_bench.json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    config = EngineConfig(dtype=args.dtype, max_num_seqs=max(batches), max_model_len=512)
    core, files = build_engine_core(config)
    model_dtype = next(core.backend.model.parameters()).dtype  # type: ignore[attr-defined]
    rows: list[dict[str, Any]] = []
    for batch in batches:
        bench_engine_decode(core, batch, 4)  # warm-up at this shape
        row: dict[str, Any] = {"batch": batch, **bench_engine_decode(core, batch, args.tokens)}
        if not args.skip_transformers:
            row["hf_loop_tok_s"] = bench_transformers(str(files.path), model_dtype, batch, args.tokens, False)
            row["hf_generate_tok_s"] = bench_transformers(str(files.path), model_dtype, batch, args.tokens, True)
            row["vs_hf_loop"] = row["tok_s"] / row["hf_loop_tok_s"]
            row["vs_hf_generate"] = row["tok_s"] / row["hf_generate_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    offline = asyncio.run(bench_offline(EngineConfig(dtype=args.dtype, max_num_seqs=32, max_model_len=512),
                                        args.offline_requests, args.tokens))
    header = ["batch", "tok_s", "hf_loop_tok_s", "hf_generate_tok_s", "vs_hf_loop", "vs_hf_generate", "step_ms",
              "forward_ms", "sample_ms", "prepare_ms", "schedule_ms", "process_ms", "outside_forward_frac"]
    print(f"\nmodel dtype: {model_dtype}; threads: {torch.get_num_threads()}")
    print(" | ".join(f"{h:>12}" for h in header))
    for row in rows:
        print(" | ".join(f"{row.get(h, float('nan')):>12.3f}" if isinstance(row.get(h, 0.0), float)
                         else f"{row.get(h):>12}" for h in header))
    print(f"\noffline AsyncEngine: {offline['requests']} requests, {offline['output_tokens']} tokens in "
          f"{offline['seconds']:.1f}s = {offline['tok_s']:.1f} tok/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"dtype": str(model_dtype), "decode": rows, "offline": offline}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
