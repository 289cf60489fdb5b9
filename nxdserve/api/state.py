"""What every handler needs: the engine, the names it is served under, and per-request ids."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from nxdserve.api.engine_protocol import EngineClient
from nxdserve.api.errors import APIError, format_validation_error, model_not_found
from nxdserve.api.multimodal import MediaOptions

logger = logging.getLogger("nxdserve.requests")

M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerState:
    engine: EngineClient  # AsyncEngine or DataParallelEngine (tests may pass a stand-in)
    served_model_names: list[str]
    api_key: str | list[str] | None = None
    log_requests: bool = False
    max_log_len: int | None = None  # --max-log-len: prompt characters / token ids per log line; None: all
    responses: Any = None  # the Responses API's store (responses_api.ResponseStore)
    media: MediaOptions = field(default_factory=MediaOptions)  # image sources and per-prompt limits
    extra: dict[str, Any] = field(default_factory=dict)

    def log_request(self, request_id: str, prompts: Sequence[str | list[int]], params: Any) -> None:
        if not self.log_requests:
            return
        shown = [p[: self.max_log_len] for p in prompts]
        logger.info("Received request %s: prompts=%r, params=%s", request_id, shown, params)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_logprobs(self) -> int:
        return int(self.engine.config.max_logprobs)

    def resolve_model(self, requested: str | None) -> str:
        """The name to echo in responses: the first served name for any of them (vLLM's ``base_model_paths[0]``),
        or a LoRA adapter's; 404 for one not served."""
        if requested is None or requested == "" or requested in self.served_model_names:
            return self.model_name
        if self.lora_for(requested) is None:
            raise model_not_found(requested)
        return requested

    def lora_for(self, model: str) -> Any:
        """The registered ``LoRARequest`` a request's ``model`` names, or None for the base model."""
        if model in self.served_model_names:
            return None
        list_loras = getattr(self.engine, "list_loras", None)
        return next((r for r in list_loras() if r.lora_name == model), None) if list_loras else None


def get_state(request: Request) -> ServerState:
    return request.app.state.nxdserve


def client_request_id(request: Request, body_id: str | None = None) -> str | None:
    """The id the client chose: its X-Request-Id header, else the body's ``request_id`` (vLLM's order)."""
    return request.scope.get("state", {}).get("client_request_id") or body_id or None


def base_request_id(request: Request, body_id: str | None = None) -> str:
    """The client's id (``client_request_id``) if it sent one, else a fresh uuid."""
    return client_request_id(request, body_id) or uuid.uuid4().hex


def engine_request_ids(request: Request, response_id: str, count: int, body_id: str | None = None) -> list[str]:
    """Engine ids for the request's choices. Clients may reuse an id of their own, so ids built from
    one get a random suffix to stay unique inside the engine."""
    reused = client_request_id(request, body_id) is not None
    base = f"{response_id}-{uuid.uuid4().hex[:8]}" if reused else response_id
    return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or a 400 in the error envelope (never Starlette's defaults)."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        raise APIError(f"Unsupported Media Type: {content_type!r}; only 'application/json' is allowed.")
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise APIError(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object.")
    return data


async def parse(request: Request, model: type[M]) -> M:
    data = await read_json(request)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise format_validation_error(exc) from exc
