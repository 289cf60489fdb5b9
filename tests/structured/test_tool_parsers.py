"""Tool-call parsers on recorded outputs in each family's real format: complete, parallel, malformed, and streamed in
pieces (the streamed deltas reassemble to the non-streaming result, malformed outputs included)."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest

from nxdserve.tools import ParsedOutput, get_tool_parser
from nxdserve.tools.parsers import NamedToolCallParser, RequiredToolCallsParser
from nxdserve.tools.streaming import ToolCallStreamer, read_whole

WHOLE = object()  # expected content: the whole text (a malformed call makes it all content)
WEATHER = {"city": "Paris", "unit": "celsius"}
# (parser, recorded text, expected content, expected [(name, arguments)]); WHOLE content: a malformed call ended
# the reading, and the calls listed are the complete ones before it
RECORDED: list[tuple[str, str, Any, list[tuple[str, dict[str, Any]]]]] = [
    # Qwen2.5-Instruct with its own template (hermes format), one call after some text, then two calls
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>', "Let me check.\n", [("get_weather", WEATHER)]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>', None,
     [("get_weather", WEATHER), ("get_time", {"zone": "Europe/Paris"})]),
    ("hermes", '<tool_call>\n{"name": "ping", "arguments": {}}', None, [("ping", {})]),  # unclosed last tag
    ("hermes", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', WHOLE, []),  # cut: content
    # a complete call, then a malformed one: the first stands, the text is content
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><tool_call>oops'
               '</tool_call>', WHOLE, [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": 1}"}</tool_call>', WHOLE, []),
    ("hermes", '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>', WHOLE, []),  # no name
    # the arguments have closed but the call object has a malformed member after them
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}, "x": tru}</tool_call>', WHOLE, []),
    # Llama 3.1 JSON (with and without the python tag), parallel calls separated by ';'
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("get_weather", WEATHER)]),
    ("llama3_json", '{"name": "a", "parameters": {"x": [1, 2, {"y": "}"}]}}; {"name": "b", "parameters": {}}', None,
     [("a", {"x": [1, 2, {"y": "}"}]}), ("b", {})]),
    ("llama3_json", "Paris is in France.", "Paris is in France.", []),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}} and more', WHOLE, [("a", {"x": 1})]),
    # Mistral: v3 list form and v11 [ARGS] form
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', None,
     [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "Sure. ",
     [("get_weather", WEATHER)]),
    ("mistral", "[TOOL_CALLS][{\"name\": \"x\", \"arguments\": 5}]", WHOLE, []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]'
                '{"zone": "CET"}', None, [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time', WHOLE,
     [("get_weather", WEATHER)]),
    # Llama 3.2 pythonic
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]', None,
     [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    ("pythonic", "[f(x=(1, 2), s='a)b')]", None, [("f", {"x": [1, 2], "s": "a)b"})]),
    ("pythonic", "It is sunny.", "It is sunny.", []),
    ("pythonic", "[get_weather(city=Paris)]", WHOLE, []),
    ("pythonic", "[f(a=1 2)]", WHOLE, []),  # a syntax error
    ("pythonic", '[f(a=b"x")]', WHOLE, []),  # literals JSON cannot hold
    ("pythonic", "[f(a={1, 2})]", WHOLE, []),
    ("pythonic", "[f(a=1e999)]", WHOLE, []),
    ("pythonic", "[f(a={[1]: 2})]", WHOLE, []),
    # whitespace before a call (Qwen3 after its thinking) is no content, streamed or not
    ("hermes", '\n\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', None, [("f", {"a": 1})]),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(zone=CET)]', WHOLE, [("get_weather", WEATHER)]),
    # tool_choice "required" cut by max_tokens inside its third call: the two complete calls stand
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time", '
                 '"parameters": {"zone": "CET"}}, {"name": "get_weather", "parameters": {"city": "Ro', WHOLE,
     [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
]


def _parser(name: str) -> Any:
    return RequiredToolCallsParser() if name == "required" else get_tool_parser(name)


def _calls(parsed: ParsedOutput) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_recorded_outputs(name: str, text: str, content: Any, calls: list[Any]) -> None:
    parsed = _parser(name).parse(text, final=True)
    assert parsed.malformed == (content is WHOLE)
    assert parsed.content == (text if content is WHOLE else content)
    assert _calls(parsed) == calls


def _stream(parser: Any, text: str, seed: int) -> tuple[str, list[dict[str, Any]]]:
    rng = random.Random(seed)
    streamer = ToolCallStreamer(parser)
    content, calls = "", []
    cuts = [0]
    while cuts[-1] < len(text):
        cuts.append(min(len(text), cuts[-1] + rng.randint(1, 7)))
    pieces = [streamer.feed(text[a:b]) for a, b in itertools.pairwise(cuts)] + [streamer.finish()]
    for piece in pieces:
        content += piece[0]
        for delta in piece[1]:
            if "id" in delta:
                assert delta["index"] == len(calls)
                arguments = delta["function"]["arguments"]
                if parser.streams_arguments:  # the name first, the arguments as they grow
                    assert arguments == ""
                else:  # the whole call at once, as the final reading has it
                    json.loads(arguments)
                calls.append({"id": delta["id"], "name": delta["function"]["name"], "arguments": arguments})
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_streamed_deltas_reassemble_to_the_non_streaming_result(
    name: str, text: str, content: Any, calls: list[Any], seed: int
) -> None:
    """Whatever the chunking, the stream sends what the final reading returns: no call that reading drops, and
    the malformed cases' whole text as content. ``read_whole`` (the non-streamed response) reads the same."""
    parser = _parser(name)
    final = parser.parse(text, final=True)
    streamed_content, streamed = _stream(parser, text, seed)
    assert streamed_content == (final.content or "")
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in final.calls]
    assert len({c["id"] for c in streamed}) == len(streamed)  # unique ids
    whole_content, whole = read_whole(parser, text)
    assert whole_content == streamed_content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == [
        (c["name"], c["arguments"]) for c in streamed]


def test_streamed_plain_text_is_all_content_and_holds_back_a_partial_marker() -> None:
    streamer = ToolCallStreamer(get_tool_parser("hermes"))
    assert streamer.feed("Hello <tool") == ("Hello", [])  # the space waits for what follows it
    assert streamer.feed("s are fun\n") == (" <tools are fun", [])
    assert streamer.finish() == ("\n", [])


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
