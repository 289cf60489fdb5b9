"""Turning a Responses API request into chat messages: ``instructions``, the stored conversation of
``previous_response_id``, then ``input``: a string, or a list of items: messages with text content parts,
``function_call`` items (the assistant's tool calls) and ``function_call_output`` items (``role: "tool"``
results). ``reasoning`` items a client sends back with a previous output are dropped, as chat templates drop past
reasoning."""

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
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            _add_call(messages, item, i)
        elif kind == "function_call_output":
            messages.append(_call_output(item, i))
        elif kind != "reasoning":
            raise APIError(
                f"input[{i}]: item type {kind!r} is not supported; send messages, function_call and "
                "function_call_output items.",
                param="input",
            )
    return messages


def _string(item: dict[str, Any], key: str, index: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise APIError(f"input[{index}]: a {item.get('type')} item needs a string {key!r}.", param="input")
    return value


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], index: int) -> None:
    """A function_call item joins the assistant message before it (its text, or the calls made in parallel with
    it): one assistant turn carries a turn's text and all its tool calls, as chat's messages do."""
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        raise APIError(f"input[{index}]: function_call arguments must be a JSON string.", param="input")
    call = {"id": _string(item, "call_id", index), "type": "function",
            "function": {"name": _string(item, "name", index), "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: dict[str, Any], index: int) -> dict[str, Any]:
    output = item.get("output")
    if isinstance(output, list):
        output = _texts(output, index)
    if not isinstance(output, str):
        raise APIError(f"input[{index}]: function_call_output output must be a string or text parts.", param="input")
    return {"role": "tool", "tool_call_id": _string(item, "call_id", index), "content": output}


def _message(item: dict[str, Any], index: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(f"input[{index}]: unsupported role {role!r}.", param="input")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise APIError(f"input[{index}]: content must be a string or a list of parts.", param="input")
    return {"role": role, "content": _texts(content, index)}


def _texts(parts: list[Any], index: int) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            shown = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(
                f"input[{index}]: content part {shown!r} is not supported; only input_text parts are.", param="input"
            )
        texts.append(part["text"])
    return "\n".join(texts)


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
    _check_call_outputs(turn)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return system + turn, turn


def _check_call_outputs(messages: list[dict[str, Any]]) -> None:
    """Each function_call_output answers a call made earlier in the conversation (OpenAI's rule), so a result is
    never rendered without the call it belongs to."""
    called: set[str] = set()
    for message in messages:
        called.update(call["id"] for call in message.get("tool_calls") or [])
        if message["role"] == "tool" and message.get("tool_call_id") not in called:
            raise APIError(
                f"No tool call found for function call output with call_id {message.get('tool_call_id')!r}.",
                param="input",
            )
