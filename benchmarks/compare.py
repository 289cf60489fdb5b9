"""Run the same serving workloads against nxdserve and, where installed, vLLM (CPU) and llama.cpp's server.

Each server is started as a subprocess on a free loopback port, waited for on /health, driven with the
``nxdserve.bench`` library and stopped, one server after another so they never share the CPU. The table
gives each metric per server and its ratio to vLLM (or to the first peer found). See benchmarks/README.md.

With ``--rounds N`` every server starts first and stays up, paused (SIGSTOP) except while it is driven,
while the workloads run N times, one server at a time, each workload on every server back to back and the
servers' order reversed every other round, on new prompts each round. A shared VM's speed drifts by 10%
within minutes; runs of the same workload minutes apart then differ by as much as the servers do, while
adjacent runs see the same machine. The table gives each metric's median over the rounds, and each ratio as
the median of the rounds' ratios with their range.

    python benchmarks/compare.py                              # every available server, all workloads
    python benchmarks/compare.py --vllm-python ~/vllm-venv/bin/python --workloads a,d
    python benchmarks/compare.py --servers nxdserve,nxdserve-prefill-first --workloads d --scale 0.5
    python benchmarks/compare.py --vllm-python ~/vllm-venv/bin/python --workloads a --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

if importlib.util.find_spec("nxdserve") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nxdserve
from nxdserve.bench.client import (
    BenchClient,
    BenchError,
    RequestRecord,
    SamplingOptions,
    wait_for_server,
)
from nxdserve.bench.datasets import random_dataset
from nxdserve.bench.metrics import calculate_metrics, resolve_output_lens
from nxdserve.bench.runner import BenchConfig, dispatch, resolve_model, run_benchmark, token_counter, warm_up
from nxdserve.bench.tokenizer import BenchTokenizer, HFTokenizer

# The server subprocesses must run the very nxdserve this script imported.
NXDSERVE_ROOT = str(Path(nxdserve.__file__).resolve().parents[1])
SERVER_KINDS = ("nxdserve", "nxdserve-prefill-first", "nxdserve-ref", "vllm", "llamacpp")
# Ratios are taken to the first of these that ran; nxdserve-ref (another source tree, --ref-root) is the
# "before" of a before/after comparison.
REFERENCE_ORDER = ("vllm", "llamacpp", "nxdserve-ref")
# Workload s: every request under this JSON schema. The array must hold 200 records, so no row can finish
# its document (and stop early) within the workload's 64 tokens: constrained and free rows decode equally long.
LONG_ARRAY_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 200,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 16},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "ok"],
        "additionalProperties": False,
    },
}
VLLM_CPU_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
}


# -- workloads -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricSpec:
    key: str
    label: str
    higher_is_better: bool


@dataclass(frozen=True)
class Shape:
    """``num_prompts`` random prompts of ``input_len`` tokens asking for ``output_len`` (ignore_eos)."""

    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int | None = None  # None: all at once


@dataclass
class Workload:
    key: str
    metrics: list[MetricSpec]
    shapes: tuple[Shape, ...]  # full size; d has (short, long)
    smoke: tuple[Shape, ...]  # --smoke: the same pattern, small enough to check the harness in a minute
    prefill_first: bool = False  # also run on nxdserve's prefill-first mode
    extra_body: dict[str, Any] = field(default_factory=dict)  # request fields beyond the sampling defaults

    def active(self, args: argparse.Namespace) -> tuple[Shape, ...]:
        return self.smoke if args.smoke else self.shapes

    def title(self, args: argparse.Namespace) -> str:
        sh = self.active(args)
        if self.key == "d":
            short, long = sh
            return (
                f"d: {long.num_prompts} x {long.input_len}-token prompts arrive while {short.num_prompts} short "
                f"({short.input_len} in, {short.output_len} out) decode"
            )
        (one,) = sh
        load = "single stream" if one.concurrency == 1 else f"{one.concurrency} concurrent"
        schema = ", every request under a JSON schema" if self.extra_body else ""
        return f"{self.key}: {load} x ({one.input_len} in, {one.output_len} out){schema}"

    def run(self, url: str, tok: BenchTokenizer, args: argparse.Namespace) -> dict[str, Any]:
        if self.key == "d":
            short, long = self.active(args)
            return asyncio.run(run_mixed(url, tok, short, long, args.seed, args.trigger_timeout))
        (one,) = self.active(args)
        return run_standard(url, tok, one, args, self.extra_body)


THROUGHPUT = MetricSpec("output_throughput", "output tok/s", True)
REQ_THROUGHPUT = MetricSpec("request_throughput", "requests/s", True)
TOTAL_THROUGHPUT = MetricSpec("total_token_throughput", "total tok/s", True)
MEAN_TTFT = MetricSpec("mean_ttft_ms", "mean TTFT ms", False)
MEDIAN_TTFT = MetricSpec("median_ttft_ms", "median TTFT ms", False)
P99_TTFT = MetricSpec("p99_ttft_ms", "p99 TTFT ms", False)
MEDIAN_TPOT = MetricSpec("median_tpot_ms", "median TPOT ms", False)
P99_ITL = MetricSpec("p99_itl_ms", "p99 ITL ms", False)


def run_standard(
    url: str, tok: BenchTokenizer, shape: Shape, args: argparse.Namespace, extra_body: dict[str, Any] | None = None
) -> dict[str, Any]:
    num = max(1, round(shape.num_prompts * args.scale))
    reqs = random_dataset(tok, num, shape.input_len, shape.output_len, seed=args.seed)
    cfg = BenchConfig(
        base_url=url,
        max_concurrency=shape.concurrency,
        sampling=SamplingOptions(ignore_eos=True, extra_body=dict(extra_body or {})),
        percentiles=[50.0, 99.0],
        metrics_interval_s=0.0,  # no /metrics polling: keep the client's CPU use minimal
        seed=args.seed,
    )
    result = asyncio.run(run_benchmark(cfg, reqs, tok))
    return result.metrics.to_dict()


async def run_mixed(
    url: str, tok: BenchTokenizer, short_shape: Shape, long_shape: Shape, seed: int, trigger_timeout_s: float
) -> dict[str, Any]:
    """The short requests start together; once nine in ten stream, the long prompts arrive at once.

    The short requests' ITLs then show how long the long prefills stall decoding (chunked prefill should
    bound it; prefill-first does not), and the long requests' TTFT what that protection costs them.
    """
    short = random_dataset(tok, short_shape.num_prompts, short_shape.input_len, short_shape.output_len, seed=seed)
    long = random_dataset(tok, long_shape.num_prompts, long_shape.input_len, long_shape.output_len, seed=seed + 1)
    sampling = SamplingOptions(ignore_eos=True)
    async with BenchClient(url, max_connections=len(short) + len(long) + 1) as client:
        model, _ = await resolve_model(client, None)
        await warm_up(client, model, long[0], sampling)  # the long shape too: first-call costs stay out
        short_recs = [RequestRecord(r.request_id, r.prompt_len, r.expected_output_len, "short") for r in short]
        short_task = asyncio.create_task(dispatch(client, model, short, sampling, [0.0] * len(short), None, short_recs))
        deadline = time.perf_counter() + trigger_timeout_s
        # A request whose text is held back (a run of incomplete UTF-8 from random prompts) shows its first
        # token only when it ends: waiting for every short request would send the long prompts after the
        # short ones finished. Nine in ten streaming is the trigger.
        need = math.ceil(0.9 * len(short_recs))
        while (
            sum(r.ttft is not None for r in short_recs) < need
            and not short_task.done()
            and time.perf_counter() < deadline
        ):
            await asyncio.sleep(0.005)
        decoding_at_arrival = sum(1 for r in short_recs if r.ttft is not None and not r.done)
        long_recs, _, _ = await dispatch(client, model, long, sampling, [0.0] * len(long), None)
        _, _, duration = await short_task

    # How many short requests were mid-decode when the long ones arrived: all of them makes a fair test.
    out: dict[str, Any] = {"short_decoding_when_long_arrived": decoding_at_arrival}
    for name, recs in (("short", short_recs), ("long", long_recs)):
        lens = resolve_output_lens(recs, token_counter(tok))
        m = calculate_metrics(recs, lens, duration, [50.0, 99.0])
        itls = [g for r in recs for g in r.itl]
        out[f"{name}_failed"] = m.failed
        out[f"{name}_max_itl_ms"] = 1000 * max(itls) if itls else 0.0
        out[f"{name}_median_itl_ms"] = m.stats["itl"].median
        out[f"{name}_p99_itl_ms"] = m.stats["itl"].percentiles[99.0]
        out[f"{name}_mean_ttft_ms"] = m.stats["ttft"].mean
        out[f"{name}_max_ttft_ms"] = 1000 * max((r.ttft or 0.0 for r in recs if r.success), default=0.0)
    return out


WORKLOADS: dict[str, Workload] = {
    "a": Workload(
        "a",
        [THROUGHPUT, REQ_THROUGHPUT, MEAN_TTFT, MEDIAN_TTFT, MEDIAN_TPOT, P99_ITL],
        (Shape(70, 64, num_prompts=64, concurrency=32),),
        (Shape(70, 16, num_prompts=8, concurrency=8),),
    ),
    "b": Workload(
        "b",
        [MEDIAN_TPOT, THROUGHPUT, MEDIAN_TTFT],
        (Shape(32, 128, num_prompts=4, concurrency=1),),
        (Shape(32, 16, num_prompts=1, concurrency=1),),
    ),
    "c": Workload(
        "c",
        [MEDIAN_TTFT, P99_TTFT, MEDIAN_TPOT, TOTAL_THROUGHPUT],
        (Shape(1000, 32, num_prompts=16, concurrency=8),),
        (Shape(300, 8, num_prompts=4, concurrency=4),),
    ),
    "d": Workload(
        "d",
        [
            MetricSpec("short_max_itl_ms", "short: max ITL ms", False),
            MetricSpec("short_median_itl_ms", "short: median ITL ms", False),
            MetricSpec("long_mean_ttft_ms", "long: mean TTFT ms", False),
            MetricSpec("long_max_ttft_ms", "long: max TTFT ms", False),
        ],
        (Shape(64, 128, num_prompts=24), Shape(1500, 16, num_prompts=4)),
        (Shape(32, 24, num_prompts=4), Shape(400, 4, num_prompts=1)),
        prefill_first=True,
    ),
    "s": Workload(
        "s",
        [THROUGHPUT, MEDIAN_TPOT, MEAN_TTFT],
        (Shape(70, 64, num_prompts=64, concurrency=32),),
        (Shape(70, 16, num_prompts=8, concurrency=8),),
        # vLLM's own request field (0.11+), which nxdserve takes too; compare with workload a, same shape, free.
        extra_body={"structured_outputs": {"json": LONG_ARRAY_SCHEMA, "disable_any_whitespace": True}},
    ),
}


# -- servers -------------------------------------------------------------------------------------------


@dataclass
class ServerSpec:
    name: str
    cmd: Callable[[int], list[str]]  # port -> argv
    workloads: list[str]
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)  # as launched, for the result file
    pid: int | None = None  # while running: the leader of the server's process group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_server(spec: ServerSpec, log_dir: Path, startup_timeout_s: float) -> Iterator[str]:
    """Start ``spec`` on a free loopback port, yield its base URL once healthy, then stop it."""
    port = free_port()
    argv = spec.argv = spec.cmd(port)
    log_path = log_dir / f"{spec.name}.log"
    print(f"[{spec.name}] starting: {' '.join(argv)}  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        # A new session makes the server the leader of its own process group, so stopping it also stops
        # the workers it spawns (vLLM's engine core) and nothing else.
        try:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **spec.env}, start_new_session=True
            )
        except OSError as exc:  # no such program: a failed start like any other, not the end of the run
            raise BenchError(f"cannot run {argv[0]}: {exc}") from exc
    url = f"http://127.0.0.1:{port}"
    spec.pid = proc.pid
    try:
        t0 = time.monotonic()
        wait_for_server(url, startup_timeout_s, alive=lambda: proc.poll() is None)
        print(f"[{spec.name}] healthy after {time.monotonic() - t0:.1f}s", flush=True)
        yield url
    finally:
        spec.pid = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)  # paused by run_interleaved: a stopped process ignores SIGTERM
        _stop(proc)


def _signal_group(spec: ServerSpec, sig: signal.Signals) -> None:
    if spec.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(spec.pid, sig)


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _python_has(python: str, module: str, timeout_s: float = 180.0) -> bool:
    try:
        res = subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


def build_servers(args: argparse.Namespace, model_dir: str, gguf: str | None) -> tuple[list[ServerSpec], list[str]]:
    """The servers to run, in order, and a note for each requested one that is not available."""
    wanted = SERVER_KINDS if args.servers == "auto" else tuple(s.strip() for s in args.servers.split(","))
    unknown = set(wanted) - set(SERVER_KINDS)
    if unknown:
        raise SystemExit(f"--servers: unknown {sorted(unknown)}; choose from {SERVER_KINDS}")
    workloads = [w for w in args.workloads.split(",") if w]
    threads = str(args.threads)
    specs: list[ServerSpec] = []
    notes: list[str] = []

    def nxd(chunked: bool) -> Callable[[int], list[str]]:
        def cmd(port: int) -> list[str]:
            argv = [sys.executable, "-m", "nxdserve.cli", "--host", "127.0.0.1", "--port", str(port)]
            argv += ["--max-model-len", str(args.max_model_len), "--max-num-seqs", "32", "--num-threads", threads]
            argv += ["--disable-log-requests", "--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill"]
            if args.model:
                argv += ["--model", args.model]
            return argv + shlex.split(str(args.nxdserve_args))

        return cmd

    nxd_env = {"PYTHONPATH": os.pathsep.join(filter(None, [NXDSERVE_ROOT, os.environ.get("PYTHONPATH")]))}
    if "nxdserve" in wanted:
        specs.append(ServerSpec("nxdserve", nxd(True), workloads, nxd_env))
    if "nxdserve-prefill-first" in wanted:
        pf = workloads if args.prefill_first_all else [w for w in workloads if WORKLOADS[w].prefill_first]
        if pf:
            specs.append(ServerSpec("nxdserve-prefill-first", nxd(False), pf, nxd_env))
    if "nxdserve-ref" in wanted:
        if args.ref_root:
            ref_env = {"PYTHONPATH": os.pathsep.join(filter(None, [args.ref_root, os.environ.get("PYTHONPATH")]))}
            specs.append(ServerSpec("nxdserve-ref", nxd(True), workloads, ref_env))
        elif args.servers != "auto":
            notes.append("nxdserve-ref: skipped (no --ref-root)")

    if "vllm" in wanted:
        python = args.vllm_python
        if not python:
            notes.append("vllm: skipped (no --vllm-python / $VLLM_PYTHON)")
        elif not (os.path.exists(python) and _python_has(python, "vllm")):
            notes.append(f"vllm: skipped ({python} cannot import vllm)")
        else:
            vllm_model = args.vllm_model or model_dir

            def vllm_cmd(port: int) -> list[str]:
                argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", vllm_model]
                argv += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(args.max_model_len)]
                return argv + shlex.split(str(args.vllm_args))

            specs.append(ServerSpec("vllm", vllm_cmd, workloads, dict(VLLM_CPU_ENV)))

    if "llamacpp" in wanted:
        binary = shutil.which(args.llamacpp_bin)
        model = args.llamacpp_model or gguf
        if binary is None:
            notes.append(f"llamacpp: skipped ({args.llamacpp_bin} not on PATH)")
        elif not model:
            notes.append("llamacpp: skipped (no GGUF model; pass --llamacpp-model)")
        else:
            parallel = 32

            def llama_cmd(port: int) -> list[str]:
                # llama.cpp splits -c evenly over its slots: give each slot a whole max_model_len.
                argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", threads]
                argv += ["-np", str(parallel), "-c", str(parallel * args.max_model_len), "--metrics"]
                return argv + shlex.split(str(args.llamacpp_args))

            specs.append(ServerSpec("llamacpp", llama_cmd, workloads))
    return specs, notes


def run_workload(key: str, url: str, tokenizer: BenchTokenizer, args: argparse.Namespace) -> dict[str, Any]:
    """One workload's metrics, or {"error": ...} when the run failed."""
    try:
        return WORKLOADS[key].run(url, tokenizer, args)
    except (BenchError, OSError, ValueError) as exc:
        return {"error": str(exc)}


def _failed_start(spec: ServerSpec, results: dict[str, dict[str, dict[str, Any]]], exc: BenchError) -> None:
    print(f"[{spec.name}] failed to start: {exc}", flush=True)
    for key in spec.workloads:
        results[key][spec.name] = {"error": f"server failed to start: {exc}"}


def run_sequential(
    specs: Sequence[ServerSpec],
    results: dict[str, dict[str, dict[str, Any]]],
    tokenizer: BenchTokenizer,
    args: argparse.Namespace,
    log_dir: Path,
) -> None:
    """One server at a time: started, every workload run once, stopped."""
    for spec in specs:
        try:
            with running_server(spec, log_dir, args.startup_timeout) as url:
                for key in spec.workloads:
                    t0 = time.monotonic()
                    results[key][spec.name] = run_workload(key, url, tokenizer, args)
                    print(f"[{spec.name}] workload {key} done in {time.monotonic() - t0:.1f}s", flush=True)
        except BenchError as exc:  # the server never became healthy
            _failed_start(spec, results, exc)


def start_order(specs: Sequence[ServerSpec], how: str, round_index: int) -> list[ServerSpec]:
    """The order to start the servers in: as listed, reversed, or (``rotate``) listed rotated by the round."""
    order = list(specs)
    if how == "reversed":
        return order[::-1]
    if how == "rotate" and order:
        k = round_index % len(order)
        return order[k:] + order[:k]
    return order


def _start_servers(
    stack: contextlib.ExitStack,
    specs: Sequence[ServerSpec],
    results: dict[str, dict[str, dict[str, Any]]],
    args: argparse.Namespace,
    log_dir: Path,
) -> tuple[dict[str, str], dict[str, str]]:
    """Start ``specs`` one after another, then pause them all: (their URLs, the start errors by name)."""
    urls: dict[str, str] = {}
    errors: dict[str, str] = {}
    for spec in specs:
        try:
            urls[spec.name] = stack.enter_context(running_server(spec, log_dir, args.startup_timeout))
        except BenchError as exc:
            _failed_start(spec, results, exc)
            errors[spec.name] = f"server failed to start: {exc}"
    for spec in specs:
        _signal_group(spec, signal.SIGSTOP)
    return urls, errors


def run_interleaved(
    specs: Sequence[ServerSpec],
    results: dict[str, dict[str, dict[str, Any]]],
    tokenizer: BenchTokenizer,
    args: argparse.Namespace,
    log_dir: Path,
) -> None:
    """``--rounds``: every server up at once, each workload run on each server back to back, round after round
    (the servers' order reversed every other round); results[workload][server] aggregates the rounds.

    The servers not being driven are paused (SIGSTOP to their process groups): an idle vLLM is not quiet (its
    13 gloo threads woke ~1,400 times a second), and every wake-up takes a core from the measured server.

    The order the servers start in matters on some VMs: on this project's Firecracker VMs (nested, with free
    page reporting) three identical nxdserve servers gave 704, 782 and 794 tok/s on workload a, the first
    started the slowest in every round. ``--start-order reversed`` starts the last listed server first;
    ``rotate`` starts fresh servers for every round, each round's order the listed one rotated by one more,
    so that each server is started first in as many rounds as the others and the medians over the rounds
    (taken round by round for the ratios) do not favour one."""
    how = getattr(args, "start_order", "listed")
    per_round: dict[str, dict[str, list[dict[str, Any]]]] = {key: {} for key in results}
    with contextlib.ExitStack() as stack:
        if how != "rotate":
            urls, errors = _start_servers(stack, start_order(specs, how, 0), results, args, log_dir)
        for r in range(args.rounds):
            with contextlib.ExitStack() as round_stack:
                if how == "rotate":  # each round's servers log to their own folder
                    round_logs = log_dir / f"round-{r + 1}"
                    round_logs.mkdir(parents=True, exist_ok=True)
                    urls, errors = _start_servers(round_stack, start_order(specs, how, r), results, args, round_logs)
                _run_round(r, specs, urls, errors if how == "rotate" else {}, per_round, tokenizer, args)
    for key, per_server in per_round.items():
        for name, rounds in per_server.items():
            results[key][name] = aggregate_rounds(rounds)


def _run_round(
    r: int,
    specs: Sequence[ServerSpec],
    urls: dict[str, str],
    start_errors: dict[str, str],
    per_round: dict[str, dict[str, list[dict[str, Any]]]],
    tokenizer: BenchTokenizer,
    args: argparse.Namespace,
) -> None:
    """Round r of run_interleaved: each workload on each (paused) server in turn. A server in start_errors
    failed to start for this round alone (``rotate``): the round is recorded as failed for it."""
    order = list(specs) if r % 2 == 0 else list(specs)[::-1]
    # New prompts each round (the same for every server in it): a server with a prefix cache (vLLM's is on by
    # default) would otherwise prefill a repeated prompt from its cache from round 2 on.
    round_args = argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * r})
    for key in per_round:
        for spec in order:
            if key not in spec.workloads:
                continue
            if spec.name not in urls:
                if spec.name in start_errors:
                    per_round[key].setdefault(spec.name, []).append({"error": start_errors[spec.name]})
                continue
            t0 = time.monotonic()
            _signal_group(spec, signal.SIGCONT)
            try:
                wait_for_server(urls[spec.name], 60.0)
                outcome = run_workload(key, urls[spec.name], tokenizer, round_args)
            except BenchError as exc:  # it did not answer /health after resuming
                outcome = {"error": str(exc)}
            finally:
                _signal_group(spec, signal.SIGSTOP)
            per_round[key].setdefault(spec.name, []).append(outcome)
            print(f"[{spec.name}] round {r + 1}/{args.rounds} workload {key} done in "
                  f"{time.monotonic() - t0:.1f}s", flush=True)  # fmt: skip


# -- results -------------------------------------------------------------------------------------------


def reference_server(results: dict[str, dict[str, dict[str, Any]]]) -> str | None:
    ran = {server for per_wl in results.values() for server, r in per_wl.items() if "error" not in r}
    return next((s for s in REFERENCE_ORDER if s in ran), None)


def aggregate_rounds(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One server's results for one workload over ``--rounds``: each numeric metric's median over the rounds
    (every round kept under ``rounds``). A round that failed makes the whole result that failure."""
    failed = next((r for r in rounds if "error" in r), None)
    if failed is not None:
        which = f"round {rounds.index(failed) + 1} of {len(rounds)}"
        return {"error": f"{which}: {failed['error']}", "rounds": list(rounds)}
    out: dict[str, Any] = {}
    for key in rounds[0]:
        values = [r.get(key) for r in rounds]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)
        else:
            out[key] = values[0]
    out["rounds"] = list(rounds)
    return out


def round_ratios(result: dict[str, Any], ref: dict[str, Any], key: str) -> list[float]:
    """The ratios of ``key`` round by round (result's round i over ref's round i): adjacent runs on one machine."""
    mine, theirs = result.get("rounds"), ref.get("rounds")
    if not mine or not theirs or len(mine) != len(theirs):
        return []
    pairs = [(a.get(key), b.get(key)) for a, b in zip(mine, theirs, strict=True)]
    return [a / b for a, b in pairs if isinstance(a, int | float) and isinstance(b, int | float) and b]


def _ratio_cell(result: dict[str, Any], ref: dict[str, Any], key: str) -> str:
    ratios = round_ratios(result, ref, key)
    if ratios:
        text = f"{statistics.median(ratios):.2f}x"
        return text if len(ratios) == 1 else f"{text} ({min(ratios):.2f}-{max(ratios):.2f})"
    v, ref_value = result.get(key), ref.get(key)
    if isinstance(v, float | int) and isinstance(ref_value, float | int) and ref_value:
        return f"{v / ref_value:.2f}x"
    return "-"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return "-" if value is None else str(value)


def format_table(
    results: dict[str, dict[str, dict[str, Any]]], servers: Sequence[str], args: argparse.Namespace
) -> str:
    ref = reference_server(results)
    others = [s for s in servers if s != ref] if ref else []
    header = ["workload / metric", "better", *servers, *[f"{s}/{ref}" for s in others]]
    rows: list[list[str]] = []
    for key, per_server in results.items():
        wl = WORKLOADS[key]
        rows.append([wl.title(args), "", *([""] * (len(servers) + len(others)))])
        for m in wl.metrics:
            values = [per_server.get(s, {}).get(m.key) for s in servers]
            row = ["  " + m.label, "higher" if m.higher_is_better else "lower", *[_fmt(v) for v in values]]
            ref_result = per_server.get(ref, {}) if ref else {}
            row += [_ratio_cell(per_server.get(s, {}), ref_result, m.key) for s in others]
            rows.append(row)
        for s in servers:
            if "error" in per_server.get(s, {}):
                rows.append([f"  ({s} failed: {per_server[s]['error'][:80]})", "", *([""] * (len(header) - 2))])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    if ref is None:
        lines.append("(no peer server ran: nxdserve only, no ratios)")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="auto", help=f"comma list of {', '.join(SERVER_KINDS)}; auto: all found")
    p.add_argument("--workloads", default="a,b,c,d", help="comma list of a,b,c,d,s (s: a under a JSON schema)")
    p.add_argument("--model", default=None, help="nxdserve --model (default: its embedded default model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer for the datasets (default: the model's)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2, help="compute threads each server may use")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the prompt counts of a, b, c")
    p.add_argument("--smoke", action="store_true", help="tiny versions of every workload: checks the harness")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trigger-timeout", type=float, default=300.0, help="d: max wait for the short requests")
    p.add_argument("--prefill-first-all", action="store_true", help="run every workload in prefill-first mode")
    p.add_argument("--nxdserve-args", default="", help="extra nxdserve flags")
    p.add_argument("--ref-root", default=None,
                   help="nxdserve-ref: the root of another nxdserve source tree (e.g. a worktree of an older commit), "
                   "served with the same flags: before/after comparisons")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="python of the vLLM CPU venv")
    p.add_argument("--vllm-model", default=None, help="default: nxdserve's model folder")
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags")
    p.add_argument("--llamacpp-bin", default="llama-server")
    p.add_argument("--llamacpp-model", default=None, help="GGUF file (default: nxdserve's embedded GGUF)")
    p.add_argument("--llamacpp-args", default="", help="extra llama-server flags")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the workloads N times with every server up, interleaved (see above); medians")
    p.add_argument("--start-order", choices=("listed", "reversed", "rotate"), default="listed",
                   help="--rounds: start the servers once in the listed order or the reverse, or (rotate) anew "
                   "each round, each server first in turn (see run_interleaved)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--result-file", default=None, help="default: bench-results/compare-<timestamp>.json")
    return p


def resolve_models(args: argparse.Namespace) -> tuple[str, str | None]:
    """(nxdserve's model folder, a GGUF for llama.cpp if one is known)."""
    from nxdserve.model_files import default_gguf_path, resolve_model

    model_dir = str(resolve_model(args.model))
    gguf: str | None = None
    if args.model is None:
        gguf = str(default_gguf_path())
    elif args.model.endswith(".gguf"):
        gguf = args.model
    return model_dir, gguf


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bad = [w for w in args.workloads.split(",") if w and w not in WORKLOADS]
    if bad:
        raise SystemExit(f"--workloads: unknown {bad}; choose from {sorted(WORKLOADS)}")
    model_dir, gguf = resolve_models(args)
    tokenizer = HFTokenizer.from_path(args.tokenizer or model_dir)
    specs, notes = build_servers(args, model_dir, gguf)
    for note in notes:
        print(note, flush=True)
    if not specs:
        print("nothing to run", file=sys.stderr)
        return 1

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    result_file = Path(args.result_file or f"bench-results/compare-{stamp}.json")
    log_dir = result_file.parent / f"compare-{stamp}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict[str, Any]]] = {w: {} for w in args.workloads.split(",") if w}
    run = run_interleaved if args.rounds > 1 else run_sequential
    run(specs, results, tokenizer, args, log_dir)

    servers = [s.name for s in specs]
    print()
    print(format_table(results, servers, args))
    data = {
        "date": stamp,
        "model": model_dir,
        "servers": {s.name: {"argv": s.argv, "env": s.env} for s in specs},
        "skipped": notes,
        "reference": reference_server(results),
        "smoke": args.smoke,
        "rounds": args.rounds,
        "start_order": args.start_order,
        "workloads": {k: {"title": WORKLOADS[k].title(args), "results": v} for k, v in results.items()},
        "server_logs": str(log_dir),
    }
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\nResults written to {result_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
