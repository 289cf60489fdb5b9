"""The error envelope and the mapping from exceptions to HTTP responses.

Every failure the API reports has vLLM's current shape,
``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP status, so the OpenAI SDK
raises the matching exception class (BadRequestError, NotFoundError, ...) with our message.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any, NoReturn

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from nxdserve.errors import (
    EngineDeadError,
    InvalidRequestError,
    LoRANotFoundError,
    QueueFullError,
    RequestFailedError,
)

logger = logging.getLogger(__name__)

# The type names vLLM (and the OpenAI SDK's exception classes) use per status.
_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error the API answers with directly; raised anywhere inside a handler."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        fallback = "BadRequestError" if self.status < 500 else "InternalServerError"
        return _TYPE_BY_STATUS.get(self.status, fallback)

    def body(self) -> dict[str, Any]:
        info = {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        return {"error": info}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def model_not_found(name: str) -> APIError:
    return APIError(f"The model `{name}` does not exist.", status=404, param="model")


def format_validation_error(exc: ValidationError) -> APIError:
    """One readable line per pydantic error, keeping pydantic's error type (e.g. ``less_than_equal``),
    which vLLM's clients and tests match on."""
    errors = exc.errors(include_url=False)
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err["loc"])
        parts.append(f"{loc}: {err['msg']} [type={err['type']}, input_value={_short(err.get('input'))}]")
    param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    return APIError(f"{len(errors)} validation error(s): " + "; ".join(parts), status=400, param=param)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def from_exception(exc: BaseException) -> APIError:
    """Map any exception a handler lets escape to the error the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return format_validation_error(exc)
    if isinstance(exc, InvalidRequestError):  # RequestTooLongError included
        return APIError(exc.message, status=400, param=exc.param)
    if isinstance(exc, LoRANotFoundError):
        return APIError(exc.message, status=404, param=exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(
            str(exc) or "The server is at capacity; retry later.",
            status=503,
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc) or "The engine is not running.", status=503)
    if isinstance(exc, RequestFailedError):
        return APIError(str(exc) or "The request failed in the engine.", status=500)
    logger.exception("unhandled error in a request handler", exc_info=exc)
    return APIError(f"Internal server error: {type(exc).__name__}: {exc}", status=500)


def with_request_names(exc: BaseException, params: Mapping[str, str], words: Mapping[str, str]) -> BaseException:
    """``exc`` naming the fields the client sent: an endpoint built on another's request (chat's max_tokens for
    max_completion_tokens, the Responses API on chat) renames ``param`` by ``params`` and whole words of the
    message by ``words``. Anything but a request error comes back as it is."""
    if not isinstance(exc, APIError | InvalidRequestError):
        return exc
    error = from_exception(exc)
    param = params.get(error.param, error.param) if error.param is not None else None
    message = error.message
    for old, new in words.items():
        message = re.sub(rf"\b{re.escape(old)}\b", new, message)
    if param == error.param and message == error.message:
        return exc
    return APIError(message, status=error.status, param=param, headers=error.headers)


def raise_with_request_names(exc: BaseException, params: Mapping[str, str], words: Mapping[str, str]) -> NoReturn:
    """Raise ``with_request_names(exc, ...)`` from ``exc``, or ``exc`` itself where nothing is renamed."""
    renamed = with_request_names(exc, params, words)
    if renamed is exc:
        raise exc
    raise renamed from exc


async def handle_exception(request: Request, exc: Exception) -> Response:
    """Starlette exception handler for every exception class the app registers."""
    return from_exception(exc).response()


def sse_error_frame(exc: BaseException) -> str:
    """The ``data: {"error": ...}`` frame sent when a stream fails after its headers went out."""
    return f"data: {json.dumps(from_exception(exc).body())}\n\n"
