"""Turning a Responses API request into chat messages: ``instructions``, the stored conversation of
``previous_response_id``, then ``input`` (a string, or a list of messages with text content parts)."""

from __future__ import annotations

from typing import Any

from nxdserve.api.errors import APIError
from nxdserve.api.responses_api.protocol import ResponsesRequest
from nxdserve.api.responses_api.store import ResponseStore

_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as chat messages (without instructions or history)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    if not req.input:
        raise APIError("`input` must not be empty.", param="input")
    return [_message(item, i) for i, item in enumerate(req.input)]


def _message(item: dict[str, Any], index: int) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind != "message":
        raise APIError(f"input[{index}]: item type {kind!r} is not supported; send messages.", param="input")
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(f"input[{index}]: unsupported role {role!r}.", param="input")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise APIError(f"input[{index}]: content must be a string or a list of parts.", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            shown = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(
                f"input[{index}]: content part {shown!r} is not supported; only input_text parts are.", param="input"
            )
        texts.append(part["text"])
    return {"role": role, "content": "\n".join(texts)}


def conversation(req: ResponsesRequest, store: ResponseStore) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the messages to render, the history to store with this response). As OpenAI does, instructions
    apply to this turn only: they are not carried into the stored history."""
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise APIError(
                f"Previous response with id '{req.previous_response_id}' not found.",
                status=404,
                param="previous_response_id",
            )
        history = list(previous.messages)
    turn = history + input_messages(req)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return system + turn, turn
