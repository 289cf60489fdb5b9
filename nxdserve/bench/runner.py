"""Runs a benchmark: warm-up, timed dispatch (arrival schedule + concurrency cap), load sampling, metrics."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nxdserve.bench.arrivals import arrival_times
from nxdserve.bench.client import BenchClient, BenchError, Endpoint, RequestRecord, SamplingOptions
from nxdserve.bench.datasets import SampleRequest
from nxdserve.bench.metrics import METRIC_NAMES, BenchmarkMetrics, calculate_metrics, resolve_output_lens
from nxdserve.bench.monitor import LoadMonitor, LoadSample
from nxdserve.bench.tokenizer import BenchTokenizer

logger = logging.getLogger(__name__)


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: Endpoint = "/v1/completions"
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    metric_names: list[str] = field(default_factory=lambda: list(METRIC_NAMES))
    goodput: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    warmup: bool = True
    metrics_interval_s: float = 0.5  # /metrics polling; 0 disables it
    request_timeout_s: float = 6 * 3600.0
    progress: bool = False


@dataclass
class BenchResult:
    config: BenchConfig
    model: str
    records: list[RequestRecord]
    output_lens: list[int]
    metrics: BenchmarkMetrics
    start_time: float  # perf_counter at the first dispatch; plots measure time from here
    duration_s: float
    load_samples: list[LoadSample]
    load_note: str = ""
    tokenizer_name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def token_counter(tokenizer: BenchTokenizer | None) -> Callable[[str], int] | None:
    """Counts generated tokens by re-tokenizing, for servers that report no usage."""
    if tokenizer is None:
        return None
    tok = tokenizer
    return lambda text: len(tok.encode(text, add_special_tokens=False))


async def resolve_model(client: BenchClient, model: str | None) -> tuple[str, str | None]:
    """(model id, its ``root``): the given id, or the first one the server lists."""
    models = await client.list_models()
    if model is None:
        if not models:
            raise BenchError("the server lists no models; pass --model")
        model = str(models[0]["id"])
    card = next((m for m in models if m.get("id") == model), {})
    root = card.get("root")
    return model, root if isinstance(root, str) else None


async def warm_up(client: BenchClient, model: str, req: SampleRequest, sampling: SamplingOptions) -> None:
    rec = await client.send(req, model, sampling)
    if not rec.success:
        raise BenchError(
            f"warm-up request to {client.base_url}{client.endpoint} failed: {rec.error}. "
            "Check --base-url, --endpoint, --model and the server's logs before benchmarking."
        )


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="req")
            except ImportError:
                pass

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def dispatch(
    client: BenchClient,
    model: str,
    requests: Sequence[SampleRequest],
    sampling: SamplingOptions,
    send_times: Sequence[float],
    max_concurrency: int | None,
    records: list[RequestRecord] | None = None,
    progress: bool = False,
) -> tuple[list[RequestRecord], float, float]:
    """Send ``requests[i]`` at ``send_times[i]`` s after the start, at most ``max_concurrency`` in flight.

    A request waits for a concurrency slot after its arrival time, as in vLLM. ``records`` may be passed
    pre-made so a caller can watch them fill in live. Returns (records, start perf_counter, duration s).
    """
    recs = records or [RequestRecord(r.request_id, r.prompt_len, r.expected_output_len, r.group) for r in requests]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = _Progress(len(requests), progress)

    async def one(req: SampleRequest, rec: RequestRecord) -> None:
        if sem is None:
            await client.send(req, model, sampling, rec)
        else:
            async with sem:
                await client.send(req, model, sampling, rec)
        bar.update()

    start = time.perf_counter()
    tasks: list[asyncio.Task[None]] = []
    try:
        for req, rec, at in zip(requests, recs, send_times, strict=True):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, rec)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        bar.close()
    return recs, start, time.perf_counter() - start


async def run_benchmark(
    cfg: BenchConfig,
    requests: Sequence[SampleRequest],
    tokenizer: BenchTokenizer | None = None,
    send_times: Sequence[float] | None = None,
) -> BenchResult:
    """The whole run against ``cfg.base_url``. ``send_times`` overrides the rate/burstiness schedule."""
    if not requests:
        raise BenchError("no requests to send")
    pool = cfg.max_concurrency or len(requests)
    async with BenchClient(cfg.base_url, cfg.endpoint, cfg.api_key, pool + 1, cfg.request_timeout_s) as client:
        model, _ = await resolve_model(client, cfg.model)
        if cfg.warmup:
            await warm_up(client, model, requests[0], cfg.sampling)
        times = (
            send_times
            if send_times is not None
            else arrival_times(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
        )
        monitor = LoadMonitor(cfg.base_url, client.headers, cfg.metrics_interval_s)
        if cfg.metrics_interval_s > 0:
            monitor.start()
        try:
            records, start, duration = await dispatch(
                client, model, requests, cfg.sampling, times, cfg.max_concurrency, progress=cfg.progress
            )
        finally:
            samples = await monitor.stop()

    output_lens = resolve_output_lens(records, token_counter(tokenizer))
    metrics = calculate_metrics(records, output_lens, duration, cfg.percentiles, cfg.goodput or None, cfg.metric_names)
    failed = [r for r in records if not r.success]
    for rec in failed[:10]:  # the first few say enough; a dead server would otherwise flood the log
        logger.warning("request %s failed: %s", rec.request_id, rec.error)
    return BenchResult(
        config=cfg,
        model=model,
        records=records,
        output_lens=output_lens,
        metrics=metrics,
        start_time=start,
        duration_s=duration,
        load_samples=samples,
        load_note=monitor.note,
        tokenizer_name=getattr(tokenizer, "name", ""),
    )
