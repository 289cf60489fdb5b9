"""The built-in tool-call parsers, each on its model family's real output format (formats: vLLM's parsers of the
same names)."""

from __future__ import annotations

import ast
import json
from typing import Any

from nxdserve.tools.base import (
    MalformedToolCall,
    ParsedCall,
    ParsedOutput,
    ToolParser,
    call_from_object,
    complete_prefix,
    held_back,
    mistral_call_id,
    register_tool_parser,
)
from nxdserve.tools.jsonscan import skip_ws


def _guarded(parse: Any, text: str, final: bool) -> ParsedOutput:
    """``parse(text, final, out)``, where ``out`` collects the content before the calls and the calls in order as
    they are read. A malformed call ends the reading: that content and the complete calls before it stand (a
    stream has already sent them: ``ToolCallStreamer``), and a final parse makes the whole text content (vLLM's
    rule, so that nothing the model wrote is lost)."""
    out = ParsedOutput(None)
    try:
        return parse(text, final, out)
    except MalformedToolCall:
        if final:  # the calls a stream sends are those of the partial reading, so take them from it
            return ParsedOutput(text, complete_prefix(_guarded(parse, text, False).calls), malformed=True)
        return ParsedOutput(out.content, complete_prefix(out.calls))  # the rest waits until the end decides


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """Hermes 2 Pro / 3, Qwen2.5, QwQ, Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated
    for parallel calls; the text before the first tag is content; an unclosed last tag is accepted."""

    START, END = "<tool_call>", "</tool_call>"
    needs_special_tokens = True  # Qwen's <tool_call> is an added token

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return _guarded(self._parse, text, final)

    def _parse(self, text: str, final: bool, out: ParsedOutput) -> ParsedOutput:
        calls = out.calls
        first = text.find(self.START)
        if first < 0:
            return ParsedOutput(text if final else text[: len(text) - held_back(text, self.START)])
        content = text[:first]
        out.content = content if content.strip() else None
        pos = first
        while pos >= 0:
            body_start = pos + len(self.START)
            close = text.find(self.END, body_start)
            body = text[body_start: close if close >= 0 else len(text)]
            brace = body.find("{")
            if brace < 0 or body[:brace].strip():
                if final or body[:brace].strip():
                    raise MalformedToolCall("a tool_call tag without a JSON object")
                break
            call, _ = call_from_object(body, brace, final=final or close >= 0)
            if call is not None:
                calls.append(call)
            if close < 0:
                break
            pos = text.find(self.START, close + len(self.END))
        return out


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3 JSON tool calls: an optional ``<|python_tag|>``, then ``{"name": ..., "parameters": {...}}``
    objects separated by ``;``. Content is null when there are calls."""

    TAG = "<|python_tag|>"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return _guarded(self._parse, text, final)

    def _parse(self, text: str, final: bool, out: ParsedOutput) -> ParsedOutput:
        calls = out.calls
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):]
        elif not final and self.TAG.startswith(body):
            return ParsedOutput(None)  # may still become the tag
        i = skip_ws(body, 0)
        if i >= len(body):
            return ParsedOutput(text if final and text.strip() else None)
        if body[i] != "{":
            return ParsedOutput(text)
        while i < len(body):
            call, end = call_from_object(body, i, final=final)
            if call is not None:
                calls.append(call)
            if end is None:
                break
            i = skip_ws(body, end)
            if i < len(body) and body[i] == ";":
                i = skip_ws(body, i + 1)
            if i < len(body) and body[i] != "{":
                raise MalformedToolCall("text after a tool call")
        return ParsedOutput(None, calls)


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (v3 tokenizers), or
    ``name[ARGS]{...}`` per call (v11+). Content is the text before the marker; call ids are 9 alphanumerics."""

    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    needs_special_tokens = True

    def new_call_id(self) -> str:
        return mistral_call_id()

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return _guarded(self._parse, text, final)

    def _parse(self, text: str, final: bool, out: ParsedOutput) -> ParsedOutput:
        calls = out.calls
        first = text.find(self.MARKER)
        if first < 0:
            return ParsedOutput(text if final else text[: len(text) - held_back(text, self.MARKER)])
        content = out.content = text[:first] if text[:first].strip() else None
        rest = text[first + len(self.MARKER):]
        i = skip_ws(rest, 0)
        if i < len(rest) and rest[i] == "[":
            return ParsedOutput(content, self._json_list(rest, i + 1, final, calls))
        segments = rest.split(self.MARKER)
        for k, segment in enumerate(segments):
            name, sep, args = segment.partition(self.ARGS)
            if not sep:
                if final:
                    raise MalformedToolCall("a [TOOL_CALLS] call without [ARGS]")
                break
            j = skip_ws(args, 0)
            if j >= len(args):
                if final:
                    raise MalformedToolCall("empty arguments")
                break
            wrapped = '{"name": ' + json.dumps(name.strip()) + ', "arguments": '
            closed = final or k < len(segments) - 1  # a later marker ends this call
            call, _ = call_from_object(wrapped + args[j:] + ("}" if closed else ""), 0, final=final)
            if call is not None:
                calls.append(call)
        return ParsedOutput(content, calls)

    @staticmethod
    def _json_list(text: str, i: int, final: bool, calls: list[ParsedCall]) -> list[ParsedCall]:
        while True:
            i = skip_ws(text, i)
            if i >= len(text):
                if final:
                    raise MalformedToolCall("unterminated tool call list")
                return calls
            if text[i] == "]":
                return calls
            if text[i] == ",":
                i += 1
                continue
            if text[i] != "{":
                raise MalformedToolCall("expected a tool call object")
            call, end = call_from_object(text, i, final=final)
            if call is not None:
                calls.append(call)
            if end is None:
                return calls
            i = end


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    """Llama 3.2 / 4 and ToolACE: a Python list of calls, ``[get_weather(city="Paris"), f(x=1)]``, with no other
    text. A call streams whole (name and arguments together) once its closing parenthesis arrives."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return _guarded(self._parse, text, final)

    def _parse(self, text: str, final: bool, out: ParsedOutput) -> ParsedOutput:
        calls = out.calls
        body = text.strip()
        if not body:
            return ParsedOutput(text if final and text else None)
        if not body.startswith("["):
            return ParsedOutput(text)
        if final:
            try:
                tree = ast.parse(body, mode="eval").body
            except SyntaxError as exc:
                raise MalformedToolCall(str(exc)) from exc
            if not isinstance(tree, ast.List):
                raise MalformedToolCall("not a list of calls")
            return ParsedOutput(None, [_pythonic_call(node) for node in tree.elts])
        for source in _complete_calls(body):
            try:
                tree = ast.parse(source, mode="eval").body
            except SyntaxError as exc:
                raise MalformedToolCall(str(exc)) from exc
            calls.append(_pythonic_call(tree))
        return ParsedOutput(None, calls)


def _pythonic_call(node: ast.expr) -> ParsedCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise MalformedToolCall("expected name(keyword=value, ...)")
    try:
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        # JSON has no bytes, sets or infinities: such an argument makes the call malformed, not a server error
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, RecursionError) as exc:
        raise MalformedToolCall(f"arguments must be JSON-like literals: {exc}") from exc
    return ParsedCall(node.func.id, text)


def _complete_calls(body: str) -> list[str]:
    """The calls of a partial ``[f(...), g(...`` list whose closing parenthesis has arrived."""
    calls, depth, quote, start = [], 0, "", 1
    i = 1
    while i < len(body):
        ch = body[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0 and ch == ")":
                calls.append(body[start: i + 1].strip().lstrip(","))
                start = i + 1
        i += 1
    return [c.strip() for c in calls]


class RequiredToolCallsParser(ToolParser):
    """``tool_choice: "required"``: the grammar makes the output a JSON list of ``{"name", "parameters"}``."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return _guarded(self._parse, text, final)

    def _parse(self, text: str, final: bool, out: ParsedOutput) -> ParsedOutput:
        calls = out.calls
        i = skip_ws(text, 0)
        if i >= len(text):
            if final:
                raise MalformedToolCall("no tool calls")
            return ParsedOutput(None)
        if text[i] != "[":
            raise MalformedToolCall("expected a list of tool calls")
        return ParsedOutput(None, MistralToolParser._json_list(text, i + 1, final, calls))


class NamedToolCallParser(ToolParser):
    """A named ``tool_choice``: the grammar makes the whole output the function's arguments (a length cut leaves
    them partial, streamed or not)."""

    streams_arguments = True

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        if i >= len(text):
            return ParsedOutput(None, [ParsedCall(self.function_name, "{}" if final else "", complete=final)])
        return ParsedOutput(None, [ParsedCall(self.function_name, text[i:], complete=final)])
