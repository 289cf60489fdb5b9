"""Load test for the OpenAI-compatible server (a script, not a unit test).

Phase 1 (hold): 256 concurrent streaming clients; every one must succeed (those beyond
max_num_seqs wait in the queue: the script samples /metrics to show it). Phase 2 (measure): 32
concurrent streaming requests, reported with `vllm bench serve`'s definitions:

- TTFT: request start -> first chunk with a token (text or not); ITL: every gap between later chunks, pooled;
- TPOT: (latency - ttft) / (output_tokens - 1), requests with more than one output token only;
- E2EL: request latency; throughputs: completed / duration, output tokens / duration,
  (prompt + output tokens) / duration, with token counts from the server's usage chunk.

    python benchmarks/load_test.py                     # starts `nxdserve` on the default model
    python benchmarks/load_test.py --base-url http://127.0.0.1:8000 --model NAME
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a rainbow forms.",
    "List five uses for a paperclip.",
    "What is the capital of France, and why is it famous?",
    "Describe the taste of an orange to someone who has never had one.",
    "Give three tips for learning a new language.",
    "Summarise the plot of a heist movie in two sentences.",
    "Why is the sky blue?",
]


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Result:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    last = start
    res = Result(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    res.ok = res.output_tokens > 0
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:  # a token, even with its text held back (as vllm bench serve counts)
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.latency = time.perf_counter() - start
    if not res.ok and not res.error:
        res.error = "stream ended without [DONE] or tokens"
    return res


def gauge(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


async def watch_queue(client: httpx.AsyncClient, stop: asyncio.Event, peaks: dict[str, float]) -> None:
    while not stop.is_set():
        try:
            text = (await client.get("/metrics")).text
            peaks["max_running"] = max(peaks["max_running"], gauge(text, "vllm:num_requests_running"))
            peaks["max_waiting"] = max(peaks["max_waiting"], gauge(text, "vllm:num_requests_waiting"))
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.25)


async def run_batch(
    base_url: str, model: str, n: int, max_tokens: int, api_key: str | None
) -> tuple[list[Result], float, dict[str, float]]:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, limits=limits, headers=headers, timeout=None) as client:
        stop, peaks = asyncio.Event(), {"max_running": 0.0, "max_waiting": 0.0}
        watcher = asyncio.create_task(watch_queue(client, stop, peaks))
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one_request(client, model, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(n))
        )
        duration = time.perf_counter() - start
        stop.set()
        await watcher
    return list(results), duration, peaks


def summarize(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}
    ms = sorted(v * 1000 for v in values)
    # Linear interpolation between closest ranks, as numpy.percentile (which vllm bench uses) does.
    pos = 0.99 * (len(ms) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ms) - 1)
    p99 = ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)
    return {"mean": statistics.fmean(ms), "median": statistics.median(ms), "std": statistics.pstdev(ms), "p99": p99}


def serving_metrics(results: list[Result], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": summarize([r.ttft for r in done]),
        "tpot_ms": summarize(tpots),
        "itl_ms": summarize([gap for r in done for gap in r.itl]),
        "e2el_ms": summarize([r.latency for r in done]),
    }


def print_table(title: str, m: dict[str, Any]) -> None:
    print(f"\n{'=' * 20} {title} {'=' * 20}")
    rows = [
        ("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", f"{m['duration_s']:.2f}"),
        ("Total input tokens", m["total_input_tokens"]), ("Total generated tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{m['total_token_throughput']:.2f}"),
    ]  # fmt: skip
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {label} (ms)", f"{m[key][stat]:.2f}"))
    for name, value in rows:
        print(f"{name:<36}{value:>14}")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "nxdserve.cli", "--host", "127.0.0.1", "--port", str(port),
        "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
        "--served-model-name", args.model, "--disable-log-requests", "--log-level", "warning",
        *args.server_args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env, cwd=REPO)
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="")
        if line.startswith("nxdserve ready:"):
            return proc, f"http://127.0.0.1:{port}"
    raise SystemExit(f"the server exited with code {proc.wait()}")


async def main_async(args: argparse.Namespace, base_url: str) -> int:
    print(f"hold: {args.hold_clients} concurrent streaming clients, max_tokens={args.hold_max_tokens}")
    hold, hold_duration, peaks = await run_batch(
        base_url, args.model, args.hold_clients, args.hold_max_tokens, args.api_key
    )
    hold_metrics = {**serving_metrics(hold, hold_duration), **peaks}
    errors = sorted({r.error for r in hold if not r.ok})
    print_table(f"hold: {args.hold_clients} concurrent clients", hold_metrics)
    print(f"{'Peak running / waiting':<36}{peaks['max_running']:>7.0f} /{peaks['max_waiting']:>5.0f}")
    for err in errors[:5]:
        print("error:", err)

    print(f"\nmeasure: {args.concurrency} concurrent requests, max_tokens={args.max_tokens}")
    measured, duration, _ = await run_batch(base_url, args.model, args.concurrency, args.max_tokens, args.api_key)
    metrics = serving_metrics(measured, duration)
    print_table(f"{args.concurrency} concurrent requests", metrics)

    report = {"base_url": base_url, "hold": hold_metrics, "hold_errors": errors, "measure": metrics,
              "config": {k: v for k, v in vars(args).items() if k != "api_key"},
              "hold_results_sample": [asdict(r) for r in hold[:3]]}  # fmt: skip
    Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_file).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.result_file}")
    ok = metrics["failed"] == 0 and hold_metrics["failed"] == 0
    print("PASS: zero errors" if ok else "FAIL: some requests failed")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="an already running server; default: start one")
    p.add_argument("--model", default="default", help="served model name to request")
    p.add_argument("--api-key", default=os.environ.get("NXDSERVE_API_KEY"))
    p.add_argument("--hold-clients", type=int, default=256)
    p.add_argument("--hold-max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64, help="for the server this script starts")
    p.add_argument("--max-model-len", type=int, default=512, help="for the server this script starts")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more flags for `nxdserve`")
    p.add_argument("--result-file", default=str(REPO / "bench-results" / "load_test.json"))
    args = p.parse_args()
    proc = None
    base_url = args.base_url
    if base_url is None:
        proc, base_url = start_server(args)
    try:
        return asyncio.run(main_async(args, base_url))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)


if __name__ == "__main__":
    sys.exit(main())
