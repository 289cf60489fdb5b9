"""nxdserve: a standalone asyncio LLM serving engine for AWS Neuron (NxD Inference)."""

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
