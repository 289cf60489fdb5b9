"""Function tools on POST /v1/responses through the official openai SDK, streaming and not: forced (named and
required) calls enforced by the grammar, ``auto`` read by the server's tool-call parser, the typed function-call
events, function_call / function_call_output items in the next turn, and 400s for what is not served.

One server with vLLM's tool flags (--enable-auto-tool-choice, a llama3-style JSON tool-call parser) and a
template that prints tools, calls and tool results. SmolLM2 does not call tools by itself: ``auto`` is exercised
by constraining its output (``text.format`` json_schema) to a llama3-style call, which the parser reads. Every
response is checked against the SDK's own pydantic types (``Response``, ``ResponseStreamEvent``), the ground truth
for field names.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from nxdserve.api.chat_output import ChatOutputPlan
from nxdserve.api.protocol import ChatCompletionRequest
from nxdserve.api.responses_api.events import EventWriter, OutputItems
from nxdserve.api.server import BackgroundServer
from tests.api.conftest import API_KEY, MODEL_NAME, _openai, engine_config, start_server
from tests.api.test_structured_tools_api import TEMPLATE

pytestmark = pytest.mark.anyio

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS,
           "strict": True}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"],
                       "additionalProperties": False}}
QUESTION = "What is the weather in Paris for the next 3 days?"
# A llama3_json call ({"name", "parameters"}), as text.format: the model writes it, the parser reads it.
CALL_FORMAT = {"format": {"type": "json_schema", "name": "call", "schema": {
    "type": "object", "properties": {"name": {"enum": ["get_weather"]}, "parameters": WEATHER_PARAMS},
    "required": ["name", "parameters"], "additionalProperties": False}}}
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_output_tokens": 60}
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def tools_server() -> Iterator[BackgroundServer]:
    # llama3_json keeps special tokens in the text; the EOS token's "<|im_end|>" stays out of it (as in vLLM).
    server = start_server(api_key=API_KEY, enable_auto_tool_choice=True, tool_call_parser="llama3_json",
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


def _checked(resp: Response) -> Response:
    """The response as the SDK's strict model sees it (the client builds it without validating)."""
    return Response.model_validate(resp.model_dump(mode="json", by_alias=True, exclude_unset=True))


def _calls(resp: Response) -> list[Any]:
    return [item for item in resp.output if item.type == "function_call"]


async def _stream(client: AsyncOpenAI, **kw: Any) -> list[Any]:
    stream = await client.responses.create(model=MODEL_NAME, stream=True, **kw)
    events = [event async for event in stream]
    for event in events:  # every event validates against the SDK's own event types
        EVENT.validate_python(event.model_dump(mode="json", by_alias=True, exclude_unset=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def _reassemble(events: list[Any]) -> list[dict[str, Any]]:
    """The function_call items a client rebuilds from the added / arguments-delta events, checked against the
    arguments-done and item-done events on the way."""
    items: dict[int, dict[str, Any]] = {}
    for e in events:
        if e.type == "response.output_item.added" and e.item.type == "function_call":
            assert e.item.arguments == "" and e.item.status == "in_progress"
            items[e.output_index] = {"id": e.item.id, "call_id": e.item.call_id, "name": e.item.name, "arguments": ""}
        elif e.type == "response.function_call_arguments.delta":
            assert items[e.output_index]["id"] == e.item_id
            items[e.output_index]["arguments"] += e.delta
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == items[e.output_index]["arguments"] and e.item_id == items[e.output_index]["id"]
        elif e.type == "response.output_item.done" and e.item.type == "function_call":
            assert e.item.arguments == items[e.output_index]["arguments"] and e.item.status == "completed"
    return [items[k] for k in sorted(items)]


async def test_named_function_gives_a_function_call_item(client: AsyncOpenAI) -> None:
    kw: dict[str, Any] = {"input": QUESTION, "tools": [WEATHER, TIME], **GREEDY,
                          "tool_choice": {"type": "function", "name": "get_time"}}
    resp = _checked(await client.responses.create(model=MODEL_NAME, **kw))
    assert resp.status == "completed" and resp.tool_choice.type == "function"  # type: ignore[union-attr]
    [item] = resp.output
    assert item.type == "function_call" and item.name == "get_time" and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")  # type: ignore[union-attr]
    assert json.loads(item.arguments)["zone"] in ("CET", "UTC")
    assert [t.name for t in resp.tools] == ["get_weather", "get_time"]  # type: ignore[union-attr]

    events = await _stream(client, **kw)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    [streamed] = _reassemble(events)
    assert (streamed["name"], streamed["arguments"]) == (item.name, item.arguments)
    final = events[-1].response.output
    assert [(i.id, i.call_id, i.arguments) for i in final] == [
        (streamed["id"], streamed["call_id"], streamed["arguments"])]


async def test_required_and_parallel_tool_calls(client: AsyncOpenAI) -> None:
    kw: dict[str, Any] = {"input": QUESTION, "tools": [WEATHER, TIME], "tool_choice": "required", **GREEDY,
                          "max_output_tokens": 80}
    resp = _checked(await client.responses.create(model=MODEL_NAME, **kw))
    calls = _calls(resp)
    assert calls and resp.status == "completed"
    assert len({c.call_id for c in calls}) == len(calls) and len({c.id for c in calls}) == len(calls)
    for c in calls:
        args = json.loads(c.arguments)
        assert set(args) == ({"city", "days"} if c.name == "get_weather" else {"zone"})
    events = await _stream(client, **kw)
    assert [(c["name"], c["arguments"]) for c in _reassemble(events)] == [(c.name, c.arguments) for c in calls]
    one = _checked(await client.responses.create(model=MODEL_NAME, parallel_tool_calls=False, **kw))
    assert len(_calls(one)) == 1 and one.parallel_tool_calls is False


async def test_auto_reads_the_parsers_calls(client: AsyncOpenAI) -> None:
    kw: dict[str, Any] = {"input": QUESTION, "tools": [WEATHER], "text": CALL_FORMAT, **GREEDY, "max_output_tokens": 40}
    resp = _checked(await client.responses.create(model=MODEL_NAME, **kw))
    [call] = resp.output  # content is null when the llama3 parser finds calls: no message item
    assert call.type == "function_call" and call.name == "get_weather"
    args = json.loads(call.arguments)
    assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7
    assert resp.tool_choice == "auto" and resp.text.format.type == "json_schema"  # type: ignore[union-attr]
    events = await _stream(client, **kw)
    assert [(c["name"], c["arguments"]) for c in _reassemble(events)] == [(call.name, call.arguments)]
    assert not any(e.type == "response.output_text.delta" for e in events)
    # tool_choice none: the tools still reach the template, the same text comes back as a message.
    plain = _checked(await client.responses.create(model=MODEL_NAME, tool_choice="none", **kw))
    [message] = plain.output
    assert message.type == "message" and json.loads(plain.output_text)["parameters"] == args


async def test_truncated_call_is_incomplete(client: AsyncOpenAI) -> None:
    resp = _checked(await client.responses.create(model=MODEL_NAME, input=QUESTION, tools=[WEATHER],  # type: ignore[list-item]
                                                  tool_choice={"type": "function", "name": "get_weather"},
                                                  temperature=0.0, max_output_tokens=3))
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    [item] = resp.output
    assert item.type == "function_call" and item.status == "incomplete"
    events = await _stream(client, input=QUESTION, tools=[WEATHER], temperature=0.0, max_output_tokens=3,
                           tool_choice={"type": "function", "name": "get_weather"})
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"


async def _prompt_tokens(http: httpx.AsyncClient, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                         ) -> tuple[int, str]:
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    tok = (await http.post("/tokenize", json={"messages": messages, "tools": chat_tools})).json()
    rendered = (await http.post("/detokenize", json={"tokens": tok["tokens"]})).json()["prompt"]
    return tok["count"], rendered


async def test_function_call_output_next_turn(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
    first = await client.responses.create(model=MODEL_NAME, input=QUESTION, tools=[WEATHER],  # type: ignore[list-item]
                                          tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
    [call] = _calls(first)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    follow = _checked(await client.responses.create(model=MODEL_NAME, input=[result], tools=[WEATHER],  # type: ignore[list-item]
                                                    previous_response_id=first.id, temperature=0.0,
                                                    max_output_tokens=4))
    assert follow.output[0].type == "message" and follow.status in ("completed", "incomplete")
    # The chain rendered the user turn, the assistant's call and the tool result, as chat would.
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]
    count, rendered = await _prompt_tokens(http, messages, [WEATHER])
    assert follow.usage is not None and follow.usage.input_tokens == count
    assert "Tools: get_weather" in rendered and '"name": "get_weather"' in rendered
    assert "<|im_start|>tool\nSunny, 21 C<|im_end|>" in rendered
    # The same turn sent as explicit items (a stateless client), the output of the first response passed back.
    items = [{"role": "user", "content": QUESTION}, *[i.model_dump(exclude_none=True) for i in first.output],
             result]
    stateless = await client.responses.create(model=MODEL_NAME, input=items, tools=[WEATHER], store=False,  # type: ignore[arg-type,list-item]
                                              temperature=0.0, max_output_tokens=4)
    assert stateless.usage is not None and stateless.usage.input_tokens == count
    assert stateless.output_text == follow.output_text
    # A result for a call nobody made is a 400.
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL_NAME, input=[{**result, "call_id": "call_unknown"}],
                                      previous_response_id=first.id)  # type: ignore[list-item]
    assert info.value.body["param"] == "input"  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
        ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://x"}]}, "tools"),
        ({"tools": [WEATHER, {"type": "computer_use_preview", "display_width": 1, "display_height": 1,
                              "environment": "linux"}]}, "tools"),
        ({"tools": [{"type": "function", "parameters": {}}]}, "tools"),
        ({"tools": [{**WEATHER, "parameters": "not a schema"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "text": CALL_FORMAT}, "tool_choice"),
        ({"text": {"format": {"type": "json_object"}}}, "text"),
        ({"input": [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": {}}]}, "input"),
    ],
)
async def test_bad_tools_are_400s_and_the_engine_keeps_serving(http: httpx.AsyncClient, extra: dict[str, Any],
                                                               param: str) -> None:
    for stream in (False, True):
        r = await http.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2,
                                                   "stream": stream, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    r = await http.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["output"][0]["type"] == "message"


async def test_auto_without_the_flags_matches_chat(http_default: httpx.AsyncClient) -> None:
    """No --enable-auto-tool-choice: function tools with the default (auto) choice are chat's 400."""
    r = await http_default.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", "tools": [WEATHER]})
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}]
    c = await http_default.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "tools": chat_tools})
    assert r.status_code == c.status_code == 400
    assert r.json()["error"] == c.json()["error"] and r.json()["error"]["param"] == "tool_choice"
    # tool_choice none needs no parser: the tools reach the template, the answer is text.
    plain = await http_default.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", "tools": [WEATHER],
                                                           "tool_choice": "none", "max_output_tokens": 2})
    assert plain.status_code == 200 and plain.json()["output"][0]["type"] == "message"


@pytest.fixture
async def http_default(server: BackgroundServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=120) as c:
        yield c


# -- reasoning items, without a model: the items and events built from a reasoning model's text ------------------

REASONING_TEXT = ('<think>Paris is in France.</think>Checking.<tool_call>\n'
                  '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>')


def _reasoning_plan() -> ChatOutputPlan:
    config = engine_config(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="deepseek_r1")
    req = ChatCompletionRequest(messages=[{"role": "user", "content": QUESTION}],  # type: ignore[list-item]
                                tools=[{"type": "function", "function": {"name": "get_weather"}}])
    return ChatOutputPlan.build(req, config)


def _shape(items: OutputItems) -> list[tuple[Any, ...]]:
    out = []
    for item in items.items:
        if item.type == "function_call":
            out.append((item.type, item.name, item.arguments, item.status))
        else:
            out.append((item.type, [part.text for part in item.content], item.status))
    return out


def _streamed_items(plan: ChatOutputPlan, text: str, chunk: int) -> OutputItems:
    """The items a stream builds from ``text`` arriving ``chunk`` characters at a time."""
    streamer, streamed = plan.streamer(), OutputItems(EventWriter())
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for n, piece in enumerate(pieces):
        streamed.chat_deltas(*streamer.feed(piece, final=n == len(pieces) - 1))
    streamed.finish("completed")
    return streamed


@pytest.mark.parametrize("chunk", [1, 7, len(REASONING_TEXT)])
def test_reasoning_text_and_calls_stream_as_the_whole_text_reads(chunk: int) -> None:
    plan = _reasoning_plan()
    whole = OutputItems(EventWriter())
    whole.chat_message(*plan.message(REASONING_TEXT))
    whole.finish("completed")
    assert _shape(whole) == [("reasoning", ["Paris is in France."], "completed"),
                             ("message", ["Checking."], "completed"),
                             ("function_call", "get_weather", '{"city": "Paris", "days": 3}', "completed")]

    streamed = _streamed_items(plan, REASONING_TEXT, chunk)
    assert _shape(streamed) == _shape(whole)
    events = [json.loads(frame.split("\ndata: ", 1)[1]) for frame in streamed.drain()]
    for event in events:
        EVENT.validate_python(event)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.output_item.added", "response.content_part.added",
                         "response.reasoning_text.delta"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Paris is in France."
    # Each item is added, then done, before the next one is added; output indexes count up.
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


MALFORMED_AFTER_A_CALL = ('<think>x</think>Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
                          '"days": 3}}</tool_call><tool_call>{"name": 1}</tool_call>')


@pytest.mark.parametrize("text", [REASONING_TEXT, MALFORMED_AFTER_A_CALL, "\n\n" + REASONING_TEXT[30:]])
@pytest.mark.parametrize("chunk", [1, 5])
def test_the_non_streamed_items_are_the_streamed_ones(text: str, chunk: int) -> None:
    """The handler's non-streamed output (finished_items) against the stream's, item by item and in order."""
    from nxdserve.api.responses_api.handlers import finished_items

    plan = _reasoning_plan()
    whole = OutputItems(EventWriter())
    finished_items(whole, plan, text)
    whole.finish("completed")
    assert _shape(_streamed_items(plan, text, chunk)) == _shape(whole)
    if text is MALFORMED_AFTER_A_CALL:  # the complete call stands; the whole text is content
        assert [kind for kind, *_ in _shape(whole)] == ["reasoning", "message", "function_call", "message"]
