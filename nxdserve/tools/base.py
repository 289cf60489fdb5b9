"""The tool-parser contract and registry.

A parser reads the whole generated text so far and says which part is content and which calls it holds. With
``final=False`` (streaming) the text may stop anywhere: a call may be partial (its arguments a prefix of their final
text, which only grows), and text that might be the start of a tool-call marker is held back from the content.
With ``final=True``, a malformed call makes the whole text content (vLLM's behaviour); the complete calls before it
stand, since a stream has sent them by then (``_guarded`` in parsers.py), so a streamed choice and a non-streamed
one read the same.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from nxdserve.tools.jsonscan import MalformedJSON, scan_object


class MalformedToolCall(ValueError):
    pass


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object; a prefix of it while ``complete`` is False
    # The call's own text has ended (its object closed): more text cannot change or invalidate it
    complete: bool = True


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)
    # A malformed call ended the reading (final: ``content`` is then the whole text, beside the calls before it)
    malformed: bool = False


def complete_prefix(calls: list[ParsedCall]) -> list[ParsedCall]:
    """The calls up to the first one still open."""
    out: list[ParsedCall] = []
    for call in calls:
        if not call.complete:
            break
        out.append(call)
    return out


class ToolParser:
    name: ClassVar[str] = ""
    # Its markers are special tokens, which the detokenizer must keep (vLLM's adjust_request).
    needs_special_tokens: ClassVar[bool] = False
    # A stream may send a call's arguments as they grow: no later text can make the call malformed (a grammar
    # writes it). Otherwise each call goes out whole once complete, so a stream never sends what the final
    # reading would not return.
    streams_arguments: ClassVar[bool] = False

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


_REGISTRY: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator; also what a ``--tool-parser-plugin`` file uses to add a parser."""

    def add(cls: type[ToolParser]) -> type[ToolParser]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def tool_parser_names() -> list[str]:
    import nxdserve.tools.parsers  # noqa: F401 - registers the built-in parsers

    return sorted(_REGISTRY)


def get_tool_parser(name: str) -> ToolParser:
    if name not in tool_parser_names():
        raise KeyError(f"unknown tool call parser {name!r}; known: {', '.join(tool_parser_names())}")
    return _REGISTRY[name]()


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (it may become the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def call_from_object(text: str, start: int, final: bool, arg_keys: tuple[str, ...] = ("arguments", "parameters")
                     ) -> tuple[ParsedCall | None, int | None]:
    """The call in the JSON object at ``text[start]`` ({"name": ..., "arguments": {...}}), and the index after the
    object (None while incomplete). A partial call (streaming) is returned once its name is complete."""
    try:
        members, end = scan_object(text, start)
    except MalformedJSON as exc:
        raise MalformedToolCall(str(exc)) from exc
    if final or end is not None:  # a closed call is read in full, so it is complete only if it is well-formed
        if end is None:
            raise MalformedToolCall("unterminated tool call")
        try:
            obj = json.loads(text[start:end])
        except json.JSONDecodeError as exc:
            raise MalformedToolCall(str(exc)) from exc
        if not isinstance(obj.get("name"), str):
            raise MalformedToolCall("a tool call without a name")
        key = next((k for k in arg_keys if k in obj), None)
        if key is None:
            return ParsedCall(obj["name"], "{}"), end
        if not isinstance(obj[key], dict):
            raise MalformedToolCall("tool call arguments are not an object")
        a, b = members[key]
        return ParsedCall(obj["name"], text[a:b]), end
    name_span = members.get("name")
    if name_span is None or name_span[1] is None:
        return None, end
    name = json.loads(text[name_span[0]:name_span[1]])
    if not isinstance(name, str):
        raise MalformedToolCall("a tool call name must be a string")
    key = next((k for k in arg_keys if k in members), None)
    if key is None:
        return ParsedCall(name, "", complete=False), end
    a, b = members[key]
    if a >= len(text) or text[a] != "{":
        return ParsedCall(name, "", complete=False), end
    return ParsedCall(name, text[a:b] if b is not None else text[a:], complete=False), end


def mistral_call_id() -> str:
    """Mistral's templates need 9 alphanumeric characters."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))
