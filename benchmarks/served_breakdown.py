"""Where a served single stream's time goes, per token and per server thread (Linux).

Drives one streaming chat completion at a time (greedy, ``ignore_eos``) against a running server and reads
the server's threads from /proc before and after: CPU time (schedstat's run time), time spent runnable but
waiting for a CPU, and voluntary / involuntary context switches, each divided by the tokens streamed; with
the wall time per token, the median gap between chunks and the client's own CPU per token. Threads under
``--min-ms`` of CPU a token are left out.

    python -m nxdserve.cli --port 8000 &
    python benchmarks/served_breakdown.py --pid $! --port 8000 --requests 4 --json /tmp/breakdown.json

Reading it: the event loop is the process's main thread (same id as the pid, printed as ``loop``); the
engine's worker thread (the forward's OpenMP master) and the OpenMP helpers are the rows with the most CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx


@dataclass
class ThreadSample:
    name: str
    run_ms: float
    wait_ms: float
    voluntary: int
    involuntary: int


def read_threads(pid: int) -> dict[int, ThreadSample]:
    threads: dict[int, ThreadSample] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
            status = dict(
                line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line
            )
            threads[int(task.name)] = ThreadSample(
                (task / "comm").read_text().strip(), int(run_ns) / 1e6, int(wait_ns) / 1e6,
                int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]),
            )
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return threads


def stream_once(client: httpx.Client, body: dict[str, object]) -> list[float]:
    """One streamed request; the arrival time of each chunk that carries text."""
    arrivals: list[float] = []
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["delta"].get("content") is not None:
                arrivals.append(time.perf_counter())
    return arrivals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pid", type=int, required=True, help="the server's process id")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-ms", type=float, default=0.005, help="leave out threads under this CPU a token")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    body: dict[str, object] = {
        "messages": [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}],
        "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True, "temperature": 0,
    }
    with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=120) as client:
        body["model"] = client.get("/v1/models").json()["data"][0]["id"]
        stream_once(client, body)  # warm-up
        before, cpu0, t0 = read_threads(args.pid), os.times(), time.perf_counter()
        tokens, gaps = 0, []
        for _ in range(args.requests):
            arrivals = stream_once(client, body)
            tokens += len(arrivals)
            gaps += [b - a for a, b in itertools.pairwise(arrivals)]
        wall, after, cpu1 = time.perf_counter() - t0, read_threads(args.pid), os.times()
    if not tokens:
        raise SystemExit("no tokens streamed")
    client_cpu = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) * 1e3
    result: dict[str, object] = {
        "tokens": tokens, "wall_ms_per_token": wall * 1e3 / tokens,
        "median_gap_ms": statistics.median(gaps) * 1e3 if gaps else None,
        "client_cpu_ms_per_token": client_cpu / tokens, "threads": {},
    }
    print(f"{tokens} tokens: wall {result['wall_ms_per_token']:.2f} ms/token, median gap between chunks "
          f"{(result['median_gap_ms'] or 0.0):.2f} ms, client CPU {result['client_cpu_ms_per_token']:.3f} ms/token")
    print(f"{'thread':>8} {'name':<16} {'CPU ms/tok':>10} {'runq ms/tok':>11} {'vol/tok':>8} {'invol/tok':>9}")
    threads: dict[str, dict[str, float | str]] = {}
    for tid, end in sorted(after.items(), key=lambda item: item[1].run_ms - before.get(item[0], item[1]).run_ms):
        start = before.get(tid, ThreadSample(end.name, 0.0, 0.0, 0, 0))
        run = (end.run_ms - start.run_ms) / tokens
        if run < args.min_ms:
            continue
        wait = (end.wait_ms - start.wait_ms) / tokens
        voluntary = (end.voluntary - start.voluntary) / tokens
        involuntary = (end.involuntary - start.involuntary) / tokens
        threads[str(tid)] = {"name": end.name, "cpu_ms": run, "runq_wait_ms": wait, "voluntary": voluntary,
                             "involuntary": involuntary}
        label = "loop" if tid == args.pid else end.name
        print(f"{tid:>8} {label:<16} {run:>10.3f} {wait:>11.3f} {voluntary:>8.2f} {involuntary:>9.2f}")
    result["threads"] = threads
    if args.json:
        args.json.write_text(json.dumps({**result, "per_thread_sample": [asdict(s) for s in after.values()]},
                                        indent=2))


if __name__ == "__main__":
    main()
