"""Aggregate metrics over timed requests, with ``vllm bench serve``'s definitions (``calculate_metrics``).

- TTFT: per-request time to the first text chunk.
- TPOT: (latency - ttft) / (output_len - 1), only for requests with more than one output token.
- ITL: every gap between text chunks, pooled across requests (one chunk may hold several tokens).
- E2EL: per-request latency.
Each as mean / median / std / chosen percentiles, in milliseconds (numpy's linear-interpolated percentile).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nxdserve.bench.client import RequestRecord

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class MetricStats:
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]  # percentile (e.g. 99.0) -> value; all in ms

    @classmethod
    def from_seconds(cls, values: Sequence[float], percentiles: Sequence[float]) -> MetricStats:
        # An empty list reads as 0 (vLLM's `np.mean(x or 0)`), so a run with no samples still reports.
        arr = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1000.0
        return cls(
            mean=float(np.mean(arr)),
            median=float(np.median(arr)),
            std=float(np.std(arr)),
            percentiles={float(p): float(np.percentile(arr, p)) for p in percentiles},
        )


def percentile_label(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9" (vLLM's key naming: p99_ttft_ms, p99.9_ttft_ms)."""
    return str(int(p)) if float(p).is_integer() else str(p)


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration_s: float
    request_throughput: float
    request_goodput: float | None  # None when no SLO was given
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, MetricStats] = field(default_factory=dict)  # "ttft" | "tpot" | "itl" | "e2el"

    def to_dict(self) -> dict[str, Any]:
        """Flat keys as in vLLM's result JSON (mean_ttft_ms, p99_itl_ms, ...)."""
        out: dict[str, Any] = {
            "duration": self.duration_s,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input,
            "total_output_tokens": self.total_output,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
            "max_concurrent_requests": self.max_concurrent_requests,
        }
        for name, st in self.stats.items():
            out[f"mean_{name}_ms"] = st.mean
            out[f"median_{name}_ms"] = st.median
            out[f"std_{name}_ms"] = st.std
            for p, v in st.percentiles.items():
                out[f"p{percentile_label(p)}_{name}_ms"] = v
        return out


def parse_goodput(specs: Iterable[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        key, sep, value = spec.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"invalid goodput SLO {spec!r}: expected one of {GOODPUT_KEYS} as NAME:MS")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"invalid goodput SLO {spec!r}: {value!r} is not a number of ms") from None
        if ms < 0 or math.isnan(ms):
            raise ValueError(f"invalid goodput SLO {spec!r}: must be non-negative")
        slos[key] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    values = [float(x) for x in text.split(",") if x.strip()]
    if not values or any(not 0 < v <= 100 for v in values):
        raise ValueError(f"percentiles must be in (0, 100], got {text!r}")
    return values


def resolve_output_lens(records: Sequence[RequestRecord], count_tokens: Callable[[str], int] | None) -> list[int]:
    """Output tokens per request: the server's usage, else the generated text re-tokenized, else chunks.

    Failed requests count 0. Re-tokenizing can differ slightly from what was sampled; usage is exact.
    """
    lens: list[int] = []
    for r in records:
        if not r.success:
            lens.append(0)
        elif r.output_tokens:
            lens.append(int(r.output_tokens))
        elif count_tokens is not None and r.generated_text:
            lens.append(count_tokens(r.generated_text))
        else:
            lens.append(len(r.chunk_times))
    return lens


def tpot_of(record: RequestRecord, output_len: int) -> float | None:
    if output_len <= 1 or record.ttft is None:
        return None
    return (record.latency - record.ttft) / (output_len - 1)


def token_times(record: RequestRecord) -> list[float]:
    """Absolute arrival time of every text chunk (first one at start + ttft)."""
    return list(record.chunk_times)


def output_tokens_per_bucket(
    records: Sequence[RequestRecord], origin: float, bucket_s: float = 1.0, weights: Sequence[float] | None = None
) -> np.ndarray:
    """Chunks (or ``weights[i]`` tokens per chunk of request i) landing in each ``bucket_s`` window."""
    ok = [(i, r) for i, r in enumerate(records) if r.success]
    if not ok:
        return np.zeros(0)
    end = max(r.end_time for _, r in ok)
    counts = np.zeros(math.ceil((end - origin) / bucket_s) + 1)
    for i, r in ok:
        w = 1.0 if weights is None else float(weights[i])
        for t in token_times(r):
            b = int((t - origin) // bucket_s)
            if 0 <= b < len(counts):
                counts[b] += w
    return counts


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once: a sweep over half-open [start, end) intervals."""
    events = [(r.start_time, 1) for r in records if r.success] + [(r.end_time, -1) for r in records if r.success]
    events.sort()  # at equal times, -1 sorts first: a request ending as another starts is not overlap
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def calculate_metrics(
    records: Sequence[RequestRecord],
    output_lens: Sequence[int],
    duration_s: float,
    percentiles: Sequence[float] = (99.0,),
    goodput_slos: dict[str, float] | None = None,
    metric_names: Sequence[str] = METRIC_NAMES,
) -> BenchmarkMetrics:
    """Aggregate ``records`` (aligned with ``output_lens``) over a run that took ``duration_s`` seconds."""
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    good = 0
    total_input = total_output = completed = 0
    for rec, out_len in zip(records, output_lens, strict=True):
        if not rec.success:
            continue
        completed += 1
        total_input += rec.prompt_len
        total_output += out_len
        ttft = rec.ttft if rec.ttft is not None else rec.latency
        tpot = tpot_of(rec, out_len)
        ttfts.append(ttft)
        e2els.append(rec.latency)
        itls.extend(rec.itl)
        if tpot is not None:
            tpots.append(tpot)
        if goodput_slos:
            # A single-token request has no TPOT; it meets any TPOT SLO (vLLM counts it as 0).
            observed = {"ttft": ttft, "tpot": tpot or 0.0, "e2el": rec.latency}
            if all(observed[k] <= ms / 1000.0 for k, ms in goodput_slos.items()):
                good += 1

    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    ok = [r for r in records if r.success]
    origin = min((r.start_time for r in ok), default=0.0)
    per_second = output_tokens_per_bucket(records, origin, 1.0)
    dur = duration_s if duration_s > 0 else float("nan")
    return BenchmarkMetrics(
        completed=completed,
        failed=len(records) - completed,
        total_input=total_input,
        total_output=total_output,
        duration_s=duration_s,
        request_throughput=completed / dur,
        request_goodput=good / dur if goodput_slos else None,
        output_throughput=total_output / dur,
        total_token_throughput=(total_input + total_output) / dur,
        max_output_tokens_per_s=float(per_second.max()) if len(per_second) else 0.0,
        max_concurrent_requests=peak_concurrency(records),
        stats={name: MetricStats.from_seconds(series[name], percentiles) for name in metric_names},
    )
