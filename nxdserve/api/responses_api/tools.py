"""The Responses API's request fields in chat's terms, so one tool-calling machinery serves both endpoints:
flat function tools (``{"type": "function", "name", "parameters", ...}``) become chat's nested ones,
``tool_choice`` ``{"type": "function", "name"}`` chat's named choice, ``text.format`` a ``response_format``."""

from __future__ import annotations

from typing import Any

from nxdserve.api.errors import APIError

# Chat's function spec keys; "strict" rides along (the grammar enforces forced calls either way).
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_CHOICE_WORDS = frozenset({"none", "auto", "required"})


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Chat's ``tools``: each ``{"type": "function", "function": {...}}``. Built-in tools (web_search,
    file_search, computer_use, mcp, ...) run on OpenAI's side; this server has none, so they are a 400."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise APIError(
                f"tools[{i}]: tool type {kind!r} is not supported; only function tools "
                '({"type": "function", "name": ...}) are served.',
                param="tools",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(f"tools[{i}]: a function tool needs a name.", param="tools")
        unknown = sorted(set(tool) - {"type", *_FUNCTION_KEYS})
        if unknown:
            raise APIError(f"tools[{i}]: unsupported function tool field(s): {', '.join(unknown)}.", param="tools")
        out.append({"type": "function", "function": {k: tool[k] for k in _FUNCTION_KEYS if k in tool}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Chat's ``tool_choice``; None is "auto" with tools and "none" without, on both endpoints."""
    if choice is None or (isinstance(choice, str) and choice in _CHOICE_WORDS):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or set(choice) - {"type", "name"}:
            raise APIError('A named tool_choice is {"type": "function", "name": ...}.', param="tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise APIError(
        f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"name\": ...}}; got {choice!r}.",
        param="tool_choice",
    )


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``: plain text, or a JSON schema the grammar enforces.
    ``json_object`` is refused, as vLLM's Responses API does."""
    if not text:
        return None
    fmt = text.get("format")
    if set(text) - {"format"} or not isinstance(fmt, dict):
        raise APIError('`text` takes {"format": {"type": "text" | "json_schema", ...}}.', param="text")
    if fmt.get("type") == "text" and set(fmt) == {"type"}:
        return None
    unknown = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
    if unknown:
        raise APIError(f"Unrecognized request argument supplied: text.format.{unknown[0]}", param="text")
    named = isinstance(fmt.get("name", ""), str)
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict) and named:
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": {"name": "response", **spec}}
    raise APIError(f"`text.format` {fmt!r} is not supported; use text or json_schema with a schema.", param="text")
