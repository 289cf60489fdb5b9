"""Tool-call parsers on recorded outputs in each family's real format: complete, parallel, malformed, and streamed in
pieces (the streamed deltas reassemble to the non-streaming result)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from nxdserve.tools import ParsedOutput, get_tool_parser
from nxdserve.tools.parsers import NamedToolCallParser, RequiredToolCallsParser
from nxdserve.tools.streaming import ToolCallStreamer

WEATHER = {"city": "Paris", "unit": "celsius"}
# (parser, recorded text, expected content, expected [(name, arguments)])
RECORDED: list[tuple[str, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    # Qwen2.5-Instruct with its own template (hermes format), one call after some text, then two calls
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>', "Let me check.\n", [("get_weather", WEATHER)]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>', None,
     [("get_weather", WEATHER), ("get_time", {"zone": "Europe/Paris"})]),
    ("hermes", '<tool_call>\n{"name": "ping", "arguments": {}}', None, [("ping", {})]),  # unclosed last tag
    ("hermes", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, None),  # malformed: content
    # Llama 3.1 JSON (with and without the python tag), parallel calls separated by ';'
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("get_weather", WEATHER)]),
    ("llama3_json", '{"name": "a", "parameters": {"x": [1, 2, {"y": "}"}]}}; {"name": "b", "parameters": {}}', None,
     [("a", {"x": [1, 2, {"y": "}"}]}), ("b", {})]),
    ("llama3_json", "Paris is in France.", "Paris is in France.", []),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}} and more', None, None),
    # Mistral: v3 list form and v11 [ARGS] form
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', None,
     [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "Sure. ",
     [("get_weather", WEATHER)]),
    ("mistral", "[TOOL_CALLS][{\"name\": \"x\", \"arguments\": 5}]", None, None),
    # Llama 3.2 pythonic
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]', None,
     [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    ("pythonic", "[f(x=(1, 2), s='a)b')]", None, [("f", {"x": [1, 2], "s": "a)b"})]),
    ("pythonic", "It is sunny.", "It is sunny.", []),
    ("pythonic", "[get_weather(city=Paris)]", None, None),
]


def _calls(parsed: ParsedOutput) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_recorded_outputs(name: str, text: str, content: str | None, calls: list[Any] | None) -> None:
    parsed = get_tool_parser(name).parse(text, final=True)
    if calls is None:  # malformed: everything is content, nothing is called
        assert parsed.content == text and parsed.calls == []
        return
    assert parsed.content == content
    assert _calls(parsed) == calls


def _stream(parser: Any, text: str, seed: int) -> tuple[str, list[dict[str, Any]]]:
    rng = random.Random(seed)
    streamer = ToolCallStreamer(parser)
    content, calls = "", []
    i = 0
    while i <= len(text):
        step = rng.randint(1, 7)
        piece = streamer.feed(text[i: i + step]) if i < len(text) else streamer.finish()
        i += step if i < len(text) else 1
        content += piece[0]
        for delta in piece[1]:
            if "id" in delta:
                assert delta["index"] == len(calls) and delta["function"]["arguments"] == ""
                calls.append({"id": delta["id"], "name": delta["function"]["name"], "arguments": ""})
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize(("name", "text", "content", "calls"), [r for r in RECORDED if r[3]])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_deltas_reassemble_to_the_non_streaming_result(
    name: str, text: str, content: str | None, calls: list[Any], seed: int
) -> None:
    parser = get_tool_parser(name)
    final = parser.parse(text, final=True)
    streamed_content, streamed = _stream(parser, text, seed)
    assert streamed_content == (final.content or "")
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in final.calls]
    assert len({c["id"] for c in streamed}) == len(streamed)  # unique ids


def test_streamed_plain_text_is_all_content_and_holds_back_a_partial_marker() -> None:
    streamer = ToolCallStreamer(get_tool_parser("hermes"))
    assert streamer.feed("Hello <tool") == ("Hello ", [])
    assert streamer.feed("s are fun") == ("<tools are fun", [])
    assert streamer.finish() == ("", [])


def test_mistral_ids_are_nine_alphanumerics() -> None:
    parser = get_tool_parser("mistral")
    ids = {parser.new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)


def test_forced_tool_choice_parsers() -> None:
    required = RequiredToolCallsParser().parse('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", '
                                               '"parameters": {}}]', final=True)
    assert _calls(required) == [("f", {"a": 1}), ("g", {})]
    named = NamedToolCallParser("f").parse('{"a": [1]}', final=True)
    assert _calls(named) == [("f", {"a": [1]})]
    content, calls = _stream(NamedToolCallParser("f"), '{"a": [1, 2]}', 0)
    assert content == "" and calls[0]["name"] == "f" and json.loads(calls[0]["arguments"]) == {"a": [1, 2]}


def test_unknown_parser_is_named() -> None:
    with pytest.raises(KeyError, match="hermes"):
        get_tool_parser("nope")
