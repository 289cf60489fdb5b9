"""nxdserve: a standalone asyncio LLM serving engine for AWS Neuron (NxD Inference)."""

import os

# Before torch loads OpenMP: with the default (active) wait policy, each multi-threaded op spins waiting for
# sibling threads that other processes (or our own event-loop thread) have descheduled, which made steps
# 10-25x slower on small machines. But a thread that sleeps at once pays a futex wake-up in each of the
# ~200 parallel regions of a decode step: a short spin first (GOMP_SPINCOUNT, a few tens of microseconds)
# made batch-1 decode 1.35x faster and batch 32 1.1x on an idle 2-core VM, and bounds what a spinning
# thread can waste when its sibling is descheduled. Either variable set by the user wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")


from nxdserve.config import EngineConfig
from nxdserve.engine.async_engine import AsyncEngine, RequestStream
from nxdserve.engine.outputs import CompletionOutput, RequestOutput
from nxdserve.errors import (
    EngineDeadError,
    InvalidRequestError,
    NxdServeError,
    QueueFullError,
    RequestTooLongError,
)
from nxdserve.sampling_params import OutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "InvalidRequestError",
    "NxdServeError",
    "OutputKind",
    "QueueFullError",
    "RequestOutput",
    "RequestStream",
    "RequestTooLongError",
    "SamplingParams",
    "__version__",
]
