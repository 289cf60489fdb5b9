"""Typed errors raised by the engine. The API layer maps them to HTTP status codes."""

from __future__ import annotations


class NxdServeError(Exception):
    """Base class for every error nxdserve raises on purpose."""


class InvalidRequestError(NxdServeError, ValueError):
    """A request that can never be served as given (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class RequestTooLongError(InvalidRequestError):
    """Prompt (plus requested output) does not fit in the model's context (HTTP 400)."""


class QueueFullError(NxdServeError):
    """The waiting queue is at its bound; the client should retry later (HTTP 503)."""


class EngineDeadError(NxdServeError):
    """The engine loop stopped and cannot serve requests any more (HTTP 503 on /health)."""


class RequestFailedError(NxdServeError):
    """The request finished with an engine error (HTTP 500)."""


class ConfigError(NxdServeError, ValueError):
    """An engine configuration that cannot work; raised at startup."""


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter that cannot be served with this base model or these limits (HTTP 400)."""


class LoRANotFoundError(NxdServeError):
    """A request or an unload named an adapter the engine does not know (HTTP 404)."""

    def __init__(self, message: str, param: str | None = "model") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
