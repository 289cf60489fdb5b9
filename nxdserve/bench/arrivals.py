"""Request arrival schedules: Poisson (burstiness 1) or gamma-distributed gaps, as ``vllm bench serve``."""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send time of each request, in seconds from the start of the run.

    Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate for any burstiness, exponential
    (a Poisson process) at 1, burstier below 1, more regular above. An infinite rate sends everything at t=0.
    As vLLM does, the times are then scaled so the last one lands at exactly num_requests/rate: the sum of
    random gaps strays a few percent from its mean, which would make throughput depend on the seed.
    """
    if num_requests <= 0:
        return []
    if request_rate <= 0:
        raise ValueError("request rate must be positive")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    times *= (num_requests / request_rate) / times[-1]
    return [float(t) for t in times]
