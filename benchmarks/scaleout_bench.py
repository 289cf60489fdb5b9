"""Scale-out benchmark (a script, not a unit test): two Ray Serve replicas against one process on the same cores.

Same run, same machine, same workload, the default model:
1. ``single``: one ``nxdserve`` process with every core (``--num-threads`` = cores, ``--max-num-seqs`` = 2 x S);
2. ``serve``:  a local Ray cluster with two NxdServeEngine replicas (nxdserve.deploy.ray_serve), one core's
   worth each (``num_cpus`` 1, ``num_threads`` 1, ``max_num_seqs`` S), behind Serve's proxy and our ingress;
3. ``direct-1``: one ``nxdserve`` process with one thread, as one replica's engine but without Serve.
Load: ``--requests`` concurrent streams of ``--max-tokens`` tokens (ignore_eos) on 1 and 2: output tokens/s and
the ratio serve / single. Hop: ``--probes`` short requests alternating between 2 and 3 (both up, one request at a
time, so neither queues nor competes with the other): the Serve hop's added TTFT is serve's p50 / p99 minus
direct-1's. The load averages before and after go into the JSON: other work on the machine moves the figures.

On this project's 2-core VM, shared with other work, two replicas have one core each, the single process two
threads; the numbers are this machine's, not a Neuron instance's. Needs ``pip install nxdserve[ray]``.

    python benchmarks/scaleout_bench.py [--requests 32 --max-tokens 64 --probes 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import PROMPTS, Result, one_request

REPO = Path(__file__).resolve().parents[1]
MODEL = "smol"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_nxdserve(threads: int, max_num_seqs: int, max_model_len: int) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "nxdserve.cli", "--host", "127.0.0.1", "--port", str(port),
           "--num-threads", str(threads), "--max-num-seqs", str(max_num_seqs), "--max-model-len",
           str(max_model_len), "--served-model-name", MODEL, "--disable-log-requests", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env, cwd=REPO)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("nxdserve ready:"):
            return proc, f"http://127.0.0.1:{port}"
    raise SystemExit(f"nxdserve exited with code {proc.wait()}")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.wait(60)


def start_serve(max_num_seqs: int, max_model_len: int, cores: int) -> str:
    import ray
    from ray import serve

    from nxdserve.deploy.ray_serve import build_app

    port = free_port()
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app({"max_num_seqs": max_num_seqs, "max_model_len": max_model_len, "num_replicas": 2,
                     "num_cpus": 1, "num_threads": 1, "served_model_name": MODEL})
    serve.run(app, name="nxdserve", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def stop_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


async def load(url: str, n: int, max_tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, MODEL, PROMPTS[i % len(PROMPTS)], max_tokens)
                                         for i in range(n)))
        duration = time.perf_counter() - start
    return summary(results, duration)


async def interleaved_probes(urls: list[str], n: int, max_tokens: int) -> list[dict[str, Any]]:
    """``n`` sequential requests to each URL, alternating between them (same moments, same machine load)."""
    clients = [httpx.AsyncClient(base_url=url, timeout=300) for url in urls]
    results: list[list[Result]] = [[] for _ in urls]
    durations = [0.0] * len(urls)
    try:
        for client in clients:
            await one_request(client, MODEL, PROMPTS[0], max_tokens)  # warm-up
        for i in range(n):
            for k, client in enumerate(clients):
                start = time.perf_counter()
                results[k].append(await one_request(client, MODEL, PROMPTS[i % len(PROMPTS)], max_tokens))
                durations[k] += time.perf_counter() - start
    finally:
        for client in clients:
            await client.aclose()
    return [summary(r, d) for r, d in zip(results, durations, strict=True)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1000 for r in ok]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "output_tok_s": sum(r.output_tokens for r in ok) / duration,
        "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99),
        "ttft_ms_mean": statistics.fmean(ttfts) if ttfts else float("nan"),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32, help="concurrent streams in the load phase")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--probes", type=int, default=20, help="sequential requests in the hop phase")
    p.add_argument("--probe-tokens", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=8, help="per replica; the single process gets twice")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--result-file", default=str(REPO / "bench-results" / "scaleout.json"))
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    report: dict[str, Any] = {"cores": cores, "config": vars(args), "loadavg_before": os.getloadavg()}

    proc, url = start_nxdserve(cores, 2 * args.max_num_seqs, args.max_model_len)
    try:
        report["single_load"] = asyncio.run(load(url, args.requests, args.max_tokens))
    finally:
        stop(proc)
    url = start_serve(args.max_num_seqs, args.max_model_len, cores)
    try:
        report["serve_load"] = asyncio.run(load(url, args.requests, args.max_tokens))
        proc, direct_url = start_nxdserve(1, args.max_num_seqs, args.max_model_len)
        try:
            report["serve_probe"], report["direct1_probe"] = asyncio.run(
                interleaved_probes([url, direct_url], args.probes, args.probe_tokens))
        finally:
            stop(proc)
    finally:
        stop_serve()
    report["loadavg_after"] = os.getloadavg()

    single, serve_, hop, direct = (report["single_load"], report["serve_load"], report["serve_probe"],
                                   report["direct1_probe"])
    report["throughput_ratio_serve_over_single"] = serve_["output_tok_s"] / single["output_tok_s"]
    report["serve_hop_added_ttft_ms_p50"] = hop["ttft_ms_p50"] - direct["ttft_ms_p50"]
    report["serve_hop_added_ttft_ms_p99"] = hop["ttft_ms_p99"] - direct["ttft_ms_p99"]
    print(f"\n{cores} cores (load average before / after: {report['loadavg_before'][0]:.1f} / "
          f"{report['loadavg_after'][0]:.1f}); load: {args.requests} concurrent streams x {args.max_tokens} tokens")
    print(f"{'':<34}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'failed':>8}")
    for name, row in (("single process, all cores", single), ("Ray Serve, 2 replicas x 1 core", serve_),
                      ("probe: Ray Serve (sequential)", hop), ("probe: direct 1-thread (sequential)", direct)):
        print(f"{name:<34}{row['output_tok_s']:>10.1f}{row['ttft_ms_p50']:>9.1f}ms{row['ttft_ms_p99']:>8.1f}ms"
              f"{row['failed']:>8}")
    print(f"throughput ratio serve / single: {report['throughput_ratio_serve_over_single']:.2f}")
    print(f"Serve hop added TTFT: p50 {report['serve_hop_added_ttft_ms_p50']:+.1f} ms, "
          f"p99 {report['serve_hop_added_ttft_ms_p99']:+.1f} ms")
    Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_file).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.result_file}")
    return 0 if all(r["failed"] == 0 for r in (single, serve_, hop, direct)) else 1


if __name__ == "__main__":
    sys.exit(main())
