"""Structured outputs and tool calling over HTTP, through the official openai SDK, streaming and not, n > 1.

One server with vLLM's tool flags (--enable-auto-tool-choice --tool-call-parser hermes) and the reasoning-free
default model. SmolLM2 does not call tools by itself: required and named tool choices are enforced by the grammar,
and ``auto`` is exercised by constraining the model (a regex) to write a hermes-format call, which the parser reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from nxdserve.api.server import BackgroundServer
from tests.api.conftest import API_KEY, MODEL_NAME, _openai, sse_events, start_server

pytestmark = pytest.mark.anyio

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}'
               r"\n</tool_call>")


# A hermes-style template (SmolLM2's own prints neither tools nor tool calls), given inline as --chat-template.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') | join(', ') }}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
    "assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tools_server() -> Iterator[BackgroundServer]:
    server = start_server(api_key=API_KEY, enable_auto_tool_choice=True, tool_call_parser="hermes",
                          structured_outputs_config={"disable_any_whitespace": True}, chat_template=TEMPLATE)
    yield server
    server.stop()


@pytest.fixture
async def client(tools_server: BackgroundServer) -> AsyncIterator[AsyncOpenAI]:
    async with _openai(tools_server) as c:
        yield c


@pytest.fixture
async def http(tools_server: BackgroundServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=tools_server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=120) as c:
        yield c


async def test_json_schema_response_format_n2(client: AsyncOpenAI) -> None:
    schema = WEATHER_TOOL["function"]["parameters"]  # type: ignore[index]
    r = await client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=40, n=2, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}},
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        doc = json.loads(choice.message.content or "")
        assert set(doc) == {"city", "days"} and 1 <= doc["days"] <= 7


async def test_json_object_streaming(client: AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60, stream=True,
                                                  response_format={"type": "json_object"}, temperature=0.0)
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # ran out of tokens inside the object: still a prefix of one
        assert finish == "length" and text.startswith("{")


async def test_choice_and_regex_fields_on_both_endpoints(client: AsyncOpenAI) -> None:
    r = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, n=3, temperature=1.5,
                                             extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert {c.message.content for c in r.choices} <= {"yes", "no"}
    r = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                             extra_body={"guided_choice": ["sunny", "rainy"]})
    assert r.choices[0].message.content in ("sunny", "rainy")
    c = await client.completions.create(model=MODEL_NAME, prompt="Code:", max_tokens=12, n=2, temperature=1.0,
                                        extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{4}"})
    assert all(re.fullmatch(r"[A-Z]{3}-[0-9]{4}", ch.text) for ch in c.choices)
    stream = await client.completions.create(model=MODEL_NAME, prompt="Code:", max_tokens=12, stream=True,
                                             extra_body={"structured_outputs": {"regex": r"[a-z]{2}[0-9]{2}"}})
    text = "".join([ch.choices[0].text async for ch in stream])
    assert re.fullmatch(r"[a-z]{2}[0-9]{2}", text)


async def test_bad_specs_are_400s_and_the_engine_keeps_serving(client: AsyncOpenAI) -> None:
    bad = [{"guided_regex": "(unclosed"}, {"guided_json": {"type": "nope"}}, {"guided_grammar": "root ::= ("},
           {"structured_outputs": {"choice": []}}, {"structured_outputs": {"json": "{"}}]
    for body in bad:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, extra_body=body)
        assert info.value.body["param"] in (*body, "structured_outputs")  # type: ignore[index]
    r = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3,
                                             extra_body={"guided_choice": ["fine"]})
    assert r.choices[0].message.content == "fine"


async def test_named_tool_choice(client: AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=40, tools=[WEATHER_TOOL, TIME_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    calls = r.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_time"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments)["zone"] in ("CET", "UTC")  # type: ignore[union-attr]


async def _stream_calls(client: AsyncOpenAI, **kw: Any) -> tuple[list[dict[str, str]], str | None, str]:
    stream = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True, **kw)
    calls: list[dict[str, str]] = []
    finish, content = None, ""
    async for chunk in stream:
        assert finish is None, "a chunk after the one with finish_reason"  # it marks the choice's last chunk
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index == len(calls) and tc.function and tc.function.name
                calls.append({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""})
            else:
                calls[tc.index]["arguments"] += tc.function.arguments or ""  # type: ignore[union-attr]
        finish = chunk.choices[0].finish_reason or finish
    return calls, finish, content


async def test_required_tool_choice_streaming_and_not(client: AsyncOpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 80, "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "required",
                          "temperature": 0.0}
    r = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)  # type: ignore[union-attr]
    assert len({c.id for c in calls}) == len(calls)
    for c in calls:
        json.loads(c.function.arguments)  # type: ignore[union-attr]
    streamed, finish, _ = await _stream_calls(client, **kw)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls]  # type: ignore[union-attr]
    one = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, parallel_tool_calls=False, **kw)
    assert len(one.choices[0].message.tool_calls or []) == 1


async def test_sdk_stream_helper_parses_the_streamed_call(client: AsyncOpenAI) -> None:
    """The SDK's ``chat.completions.stream`` parses a call's arguments when it meets the finish_reason: they must
    be whole by then (a pydantic tool, strict schema)."""
    from pydantic import BaseModel

    class GetTime(BaseModel):
        zone: str

    async with client.chat.completions.stream(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0.0, parallel_tool_calls=False,
            tools=[openai.pydantic_function_tool(GetTime)], tool_choice="required") as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    assert final.choices[0].finish_reason == "tool_calls"
    assert isinstance(call.function.parsed_arguments, GetTime)  # type: ignore[union-attr]


async def test_auto_tool_choice_reads_hermes_calls(client: AsyncOpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 60, "tools": [WEATHER_TOOL], "tool_choice": "auto",
                          "extra_body": {"guided_regex": HERMES_CALL}}
    r = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("chatcmpl-tool-") and call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")  # type: ignore[union-attr]
    streamed, finish, content = await _stream_calls(client, **kw)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (call.function.name, call.function.arguments)]  # type: ignore[union-attr]


async def test_tool_results_go_through_the_template(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    r = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                             tools=[WEATHER_TOOL])  # type: ignore[list-item]
    assert r.choices[0].finish_reason in ("stop", "length")
    tok = await http.post("/tokenize", json={"messages": messages, "tools": [WEATHER_TOOL]})
    assert tok.status_code == 200
    assert r.usage is not None and r.usage.prompt_tokens == tok.json()["count"]
    rendered = (await http.post("/detokenize", json={"tokens": tok.json()["tokens"]})).json()["prompt"]
    # The call's arguments reach the template as a dict (tojson prints them), the tool result as a tool turn.
    assert "Tools: get_weather" in rendered
    assert '"arguments": {"city": "Paris", "days": 3}' in rendered and '"name": "get_weather"' in rendered
    assert "<|im_start|>tool\nSunny, 21 C<|im_end|>" in rendered


async def test_tool_choice_errors(http: httpx.AsyncClient) -> None:
    body = {"messages": MESSAGES, "max_tokens": 3, "tools": [WEATHER_TOOL]}
    cases = [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"tool_choice": "sometimes"}, "tool_choice"),
             ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
             ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice")]
    for extra, param in cases:
        r = await http.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    r = await http.post("/v1/chat/completions", json={**body, "tool_choice": "required", "stream": True})
    assert sse_events(r.text)[-1] == "[DONE]"


async def test_sampling_extras_over_http(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "logprobs": 1, "return_tokens_as_token_ids": True}
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200
    assert all(re.fullmatch(r"token_id:\d+", t) for t in r.json()["choices"][0]["logprobs"]["tokens"])
    for extra, param in (({"priority": 3}, "priority"), ({"logits_processors": ["x"]}, "logits_processors"),
                         ({"truncate_prompt_tokens": -5}, "truncate_prompt_tokens")):
        r = await http.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 400, r.text
        assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]
    r = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4,
                                                     "allowed_token_ids": [28, 29], "bad_words": ["x"]})
    assert r.status_code == 200
