"""Serving benchmark for OpenAI-compatible servers (``nxdserve bench``), usable as a library.

``run_benchmark(BenchConfig(...), requests, tokenizer)`` runs one workload and returns a ``BenchResult``
with per-request records and vllm bench serve's aggregate metrics.
"""

from nxdserve.bench.client import BenchClient, BenchError, RequestRecord, SamplingOptions, wait_for_server
from nxdserve.bench.datasets import (
    SampleRequest,
    prefix_repetition_dataset,
    random_dataset,
    sharegpt_like_dataset,
)
from nxdserve.bench.metrics import BenchmarkMetrics, calculate_metrics
from nxdserve.bench.runner import BenchConfig, BenchResult, run_benchmark

__all__ = [
    "BenchClient",
    "BenchConfig",
    "BenchError",
    "BenchResult",
    "BenchmarkMetrics",
    "RequestRecord",
    "SampleRequest",
    "SamplingOptions",
    "calculate_metrics",
    "prefix_repetition_dataset",
    "random_dataset",
    "run_benchmark",
    "sharegpt_like_dataset",
    "wait_for_server",
]
