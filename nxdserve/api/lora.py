"""LoRA adapters over HTTP, as vLLM: adapter cards in /v1/models, and (only when
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true) ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``."""

from __future__ import annotations

import os
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from nxdserve.api.errors import APIError
from nxdserve.api.responses import ModelCard, ModelPermission
from nxdserve.api.state import ServerState, get_state, read_json
from nxdserve.lora.request import LoRARequest

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


def adapter_cards(state: ServerState) -> list[ModelCard]:
    """One card per registered adapter: ``root`` its path, ``parent`` its base model (the first served name
    unless it was registered with one)."""
    list_loras = getattr(state.engine, "list_loras", None)
    return [
        ModelCard(
            id=r.lora_name,
            root=r.lora_path,
            parent=r.base_model_name or state.model_name,
            max_model_len=int(state.engine.max_model_len),
            permission=[ModelPermission()],
        )
        for r in (list_loras() if list_loras else [])
    ]


def _field(body: dict[str, Any], name: str, kind: type, required: bool = True) -> Any:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, str) and not value):
        raise APIError(f"`{name}` must be a non-empty {kind.__name__}.", param=name)
    return value


async def load_lora_adapter(request: Request) -> Response:
    state = get_state(request)
    body = await read_json(request)
    unknown = sorted(set(body) - {"lora_name", "lora_path", "lora_int_id", "base_model_name"})
    if unknown:
        raise APIError(f"Unknown field(s) {unknown}.", param=unknown[0])
    name, path = _field(body, "lora_name", str), _field(body, "lora_path", str)
    int_id = _field(body, "lora_int_id", int, required=False)
    if int_id is None:  # vLLM numbers adapters itself when the client does not
        int_id = max((r.lora_int_id for r in state.engine.list_loras()), default=0) + 1
    lora = LoRARequest(name, int_id, path, _field(body, "base_model_name", str, required=False))
    await state.engine.add_lora(lora)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    state = get_state(request)
    body = await read_json(request)
    unknown = sorted(set(body) - {"lora_name", "lora_int_id"})
    if unknown:
        raise APIError(f"Unknown field(s) {unknown}.", param=unknown[0])
    name = _field(body, "lora_name", str)
    int_id = _field(body, "lora_int_id", int, required=False)
    known = next((r for r in state.engine.list_loras() if r.lora_name == name), None)
    if int_id is not None and known is not None and known.lora_int_id != int_id:
        raise APIError(f"LoRA adapter '{name}' has lora_int_id {known.lora_int_id}, not {int_id}.", param="lora_int_id")
    await state.engine.remove_lora(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


RUNTIME_ROUTES = [
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
]
