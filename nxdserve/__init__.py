"""nxdserve: a standalone asyncio LLM serving engine for AWS Neuron (NxD Inference)."""

import os

# Before torch loads OpenMP: with the default (active) wait policy, each multi-threaded op spins waiting for
# sibling threads that other processes (or our own event-loop thread) have descheduled, which made steps
# 10-25x slower on small machines. Passive waiting costs little when the machine is idle.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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
