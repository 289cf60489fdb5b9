"""What the API process and its engine processes say to each other over a multiprocessing pipe.

To an engine:   ("add", request_id, prompt, SamplingParams, add_special_tokens) | ("abort", request_id)
                | ("shutdown", drain_timeout_s)
From an engine: ("ready", EngineFacts) | ("out", request_id, RequestOutput) | ("error", request_id, WireError)
                | ("stats", EngineStats, metrics exposition text or None) | ("fatal", message) | ("bye",)
Everything is pickled by the pipe; errors travel as (class name, message, param) and are rebuilt as the
same nxdserve.errors type, so the API maps them to the same HTTP status as in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nxdserve import errors
from nxdserve.sampling_params import SamplingParams

WireError = tuple[str, str, str | None]

_TYPED: dict[str, type[errors.NxdServeError]] = {
    cls.__name__: cls
    for cls in (errors.InvalidRequestError, errors.RequestTooLongError, errors.QueueFullError,
                errors.EngineDeadError, errors.RequestFailedError)
}


@dataclass(frozen=True)
class EngineFacts:
    """What the API process needs to know about a started engine (it loads no model itself)."""

    model_path: str
    backend_name: str
    max_model_len: int
    max_prompt_len: int
    vocab_size: int
    max_num_seqs: int
    generation_defaults: dict[str, float | int]
    pid: int
    # The backend's admission check (Backend.request_check: picklable), run before a request's stream opens
    request_check: Callable[[SamplingParams], None] | None = None
    # The scheduling the engine runs (the nxd backend falls back to prefill-first with its own token budget)
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int | None = None


def to_wire(error: BaseException) -> WireError:
    return type(error).__name__, str(error), getattr(error, "param", None)


def from_wire(wire: WireError) -> Exception:
    name, message, param = wire
    cls = _TYPED.get(name)
    if cls is None:
        return errors.RequestFailedError(f"{name}: {message}")
    if issubclass(cls, errors.InvalidRequestError):
        return cls(message, param=param)
    return cls(message)
