"""nxdserve: a standalone asyncio LLM serving engine for AWS Neuron (NxD Inference).

Importing the package sets nothing in the process environment and loads nothing heavy: the names below are
imported on first use, so that ``nxdserve``'s CLI can set OpenMP's wait policy before torch loads
(``nxdserve.cpu_options.set_openmp_wait_policy``; an embedding program calls it, or sets the variables, itself).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nxdserve.config import EngineConfig
    from nxdserve.cpu_options import CpuOptions
    from nxdserve.engine.async_engine import AsyncEngine, RequestStream
    from nxdserve.engine.outputs import CompletionOutput, RequestOutput
    from nxdserve.errors import (
        EngineDeadError,
        InvalidRequestError,
        NxdServeError,
        QueueFullError,
        RequestTooLongError,
    )
    from nxdserve.lora.request import LoRARequest
    from nxdserve.sampling_params import OutputKind, SamplingParams



def _installed_version() -> str:
    """pyproject.toml's version, as the installed distribution records it: its one source."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nxdserve")
    except PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


__version__ = _installed_version()

_EXPORTS = {
    "AsyncEngine": "nxdserve.engine.async_engine",
    "CompletionOutput": "nxdserve.engine.outputs",
    "CpuOptions": "nxdserve.cpu_options",
    "EngineConfig": "nxdserve.config",
    "EngineDeadError": "nxdserve.errors",
    "InvalidRequestError": "nxdserve.errors",
    "LoRARequest": "nxdserve.lora.request",
    "NxdServeError": "nxdserve.errors",
    "OutputKind": "nxdserve.sampling_params",
    "QueueFullError": "nxdserve.errors",
    "RequestOutput": "nxdserve.engine.outputs",
    "RequestStream": "nxdserve.engine.async_engine",
    "RequestTooLongError": "nxdserve.errors",
    "SamplingParams": "nxdserve.sampling_params",
}

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "CpuOptions",
    "EngineConfig",
    "EngineDeadError",
    "InvalidRequestError",
    "LoRARequest",
    "NxdServeError",
    "OutputKind",
    "QueueFullError",
    "RequestOutput",
    "RequestStream",
    "RequestTooLongError",
    "SamplingParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nxdserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
