"""``nxdserve bench``: a load generator for any OpenAI-compatible server, with vllm bench serve's metrics.

Example::

    nxdserve bench --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 256 --random-output-len 64 --num-prompts 50 --max-concurrency 8 --ignore-eos
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from typing import Any

from nxdserve.bench.client import ENDPOINTS, BenchClient, BenchError, SamplingOptions
from nxdserve.bench.datasets import (
    DATASET_NAMES,
    SampleRequest,
    prefix_repetition_dataset,
    random_dataset,
    sharegpt_like_dataset,
)
from nxdserve.bench.metrics import METRIC_NAMES, parse_goodput, parse_percentiles
from nxdserve.bench.report import default_result_path, format_table, result_to_json, write_json
from nxdserve.bench.runner import BenchConfig, BenchResult, resolve_model, run_benchmark
from nxdserve.bench.tokenizer import BenchTokenizer, ServerTokenizer, resolve_tokenizer

logger = logging.getLogger("nxdserve.bench")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nxdserve bench",
        description="Benchmark an OpenAI-compatible server (nxdserve, vLLM, llama.cpp, ...) with streaming "
        "requests; reports TTFT/TPOT/ITL/E2EL and throughput as vllm bench serve does.",
    )
    srv = p.add_argument_group("server")
    srv.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    srv.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    srv.add_argument("--model", default=None, help="model id (default: the first one GET /v1/models lists)")
    srv.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    srv.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer (model dir, tokenizer.json or .gguf), or 'server' to use the server's "
        "/tokenize and /detokenize. Default: the served model's local path or nxdserve's default model "
        "when it matches the server's tokenizer, else the server's.",
    )
    srv.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")

    data = p.add_argument_group("dataset (generated locally)")
    data.add_argument("--dataset-name", default="random", choices=DATASET_NAMES)
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±r)")
    data.add_argument("--random-prefix-len", type=int, default=0, help="one random prefix shared by all")
    data.add_argument("--sharegpt-output-len", type=int, default=None, help="fix every output length")
    data.add_argument("--sharegpt-max-prompt-len", type=int, default=1024)
    data.add_argument("--sharegpt-max-total-len", type=int, default=2048)
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)

    load = p.add_argument_group("load shape and sampling")
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson, <1 burstier")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so outputs hit max_tokens")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--top-p", type=float, default=None)
    load.add_argument("--top-k", type=int, default=None)
    load.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into each request")
    load.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")

    out = p.add_argument_group("results")
    out.add_argument("--percentile-metrics", default=",".join(METRIC_NAMES), help="subset of ttft,tpot,itl,e2el")
    out.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    out.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50")
    out.add_argument("--result-file", default=None, help="default: bench-results/<timestamp>.json")
    out.add_argument("--save-detailed", action="store_true", help="also store the generated texts")
    out.add_argument("--plot-dir", default=None, help="default: <result-file without .json>-plots")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--metrics-interval", type=float, default=0.5, help="GET /metrics period, s (0: off)")
    out.add_argument("--disable-tqdm", action="store_true")
    return p


def build_dataset(args: argparse.Namespace, tokenizer: BenchTokenizer) -> list[SampleRequest]:
    if args.dataset_name == "random":
        return random_dataset(
            tokenizer,
            args.num_prompts,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            prefix_len=args.random_prefix_len,
            seed=args.seed,
        )
    if args.dataset_name == "sharegpt-like":
        return sharegpt_like_dataset(
            tokenizer,
            args.num_prompts,
            seed=args.seed,
            output_len=args.sharegpt_output_len,
            max_prompt_len=args.sharegpt_max_prompt_len,
            max_total_len=args.sharegpt_max_total_len,
        )
    return prefix_repetition_dataset(
        tokenizer,
        args.num_prompts,
        prefix_len=args.prefix_repetition_prefix_len,
        suffix_len=args.prefix_repetition_suffix_len,
        num_prefixes=args.prefix_repetition_num_prefixes,
        output_len=args.prefix_repetition_output_len,
        seed=args.seed,
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    metric_names = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = set(metric_names) - set(METRIC_NAMES)
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}; choose from {METRIC_NAMES}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    return BenchConfig(
        base_url=args.base_url.rstrip("/"),
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        sampling=SamplingOptions(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            ignore_eos=args.ignore_eos,
            extra_body=args.extra_body or {},
        ),
        percentiles=parse_percentiles(args.metric_percentiles),
        metric_names=metric_names,
        goodput=parse_goodput(args.goodput or []),
        seed=args.seed,
        warmup=not args.no_warmup,
        metrics_interval_s=args.metrics_interval,
        request_timeout_s=args.request_timeout,
        progress=not args.disable_tqdm and sys.stderr.isatty(),
    )


async def _run(args: argparse.Namespace, cfg: BenchConfig) -> BenchResult:
    async with BenchClient(cfg.base_url, cfg.endpoint, cfg.api_key, 2) as client:
        cfg.model, root = await resolve_model(client, cfg.model)
    tokenizer = resolve_tokenizer(args.tokenizer, cfg.base_url, cfg.model, root, dict(client.headers))
    logger.info(
        "model %s, tokenizer %s; building %d %s prompts", cfg.model, tokenizer.name, args.num_prompts, args.dataset_name
    )
    try:
        requests = build_dataset(args, tokenizer)
        return await run_benchmark(cfg, requests, tokenizer)
    finally:
        if isinstance(tokenizer, ServerTokenizer):
            tokenizer.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: thousands of lines in a benchmark.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"nxdserve bench: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(_run(args, cfg))
    except (BenchError, ValueError, RuntimeError) as exc:
        print(f"nxdserve bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130

    print(format_table(result))
    result_file = args.result_file or default_result_path()
    data: dict[str, Any] = result_to_json(result, args.save_detailed)
    if not args.no_plots:
        from nxdserve.bench.plots import make_plots  # matplotlib import is slow; only when plotting

        plot_dir = args.plot_dir or os.path.splitext(result_file)[0] + "-plots"
        data["plots"] = make_plots(result, plot_dir)
        for path in data["plots"]:
            print(f"Plot written to {path}")
    write_json(data, result_file)
    print(f"Results written to {result_file}")
    return 0 if result.metrics.completed > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
