"""POST /v1/responses (OpenAI's Responses API) through the official SDK: text and message input,
instructions, streaming with typed events, stored responses (retrieve, delete, previous_response_id), and
a 400 naming each field this server cannot honour."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.api.conftest import MODEL_NAME

pytestmark = pytest.mark.anyio

GREEDY = {"temperature": 0.0, "max_output_tokens": 8}


async def test_text_input_returns_a_completed_message(client: AsyncOpenAI) -> None:
    resp = await client.responses.create(model=MODEL_NAME, input="What is the capital of France?", **GREEDY)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status in ("completed", "incomplete") and resp.model == MODEL_NAME
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text" and resp.output_text == item.content[0].text
    assert resp.output_text.strip()
    assert resp.usage is not None and resp.usage.output_tokens <= 8
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens


async def test_same_prompt_as_chat_gives_the_same_text(client: AsyncOpenAI) -> None:
    """The Responses API renders the same chat template and samples alike: greedy text matches chat's."""
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
    chat = await client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=8)  # type: ignore[arg-type]
    resp = await client.responses.create(
        model=MODEL_NAME,
        instructions="Answer briefly.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}],
        **GREEDY,
    )
    assert resp.output_text == chat.choices[0].message.content
    assert resp.instructions == "Answer briefly."
    assert resp.usage is not None and resp.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]


async def test_max_output_tokens_makes_it_incomplete(client: AsyncOpenAI) -> None:
    resp = await client.responses.create(model=MODEL_NAME, input="Count from one to fifty.", temperature=0,
                                         max_output_tokens=3)  # fmt: skip
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 3


async def test_streaming_sends_the_typed_events_in_order(client: AsyncOpenAI) -> None:
    final = await client.responses.create(model=MODEL_NAME, input="Say hello.", **GREEDY)
    stream = await client.responses.create(model=MODEL_NAME, input="Say hello.", stream=True, **GREEDY)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[:4] == head and kinds[-4:-1] == tail
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == final.output_text
    done = events[-1].response  # type: ignore[union-attr]
    assert done.output_text == deltas and done.usage.output_tokens == final.usage.output_tokens  # type: ignore[union-attr]


async def test_stored_response_retrieve_continue_delete(client: AsyncOpenAI) -> None:
    first = await client.responses.create(model=MODEL_NAME, input="My name is Ada. Say OK.", **GREEDY)
    got = await client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    follow = await client.responses.create(
        model=MODEL_NAME, input="What is my name?", previous_response_id=first.id, **GREEDY
    )
    assert follow.previous_response_id == first.id
    # The follow-up's prompt holds the first turn: it is longer than the question alone.
    alone = await client.responses.create(model=MODEL_NAME, input="What is my name?", store=False, **GREEDY)
    assert follow.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens  # type: ignore[union-attr]
    await client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model=MODEL_NAME, input="Again?", previous_response_id=first.id, **GREEDY)


async def test_store_false_is_not_kept(client: AsyncOpenAI) -> None:
    resp = await client.responses.create(model=MODEL_NAME, input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(resp.id)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search_preview"}]}, "tools"),  # function tools: tests/api/test_responses_tools.py
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "json_object"}}}, "text"),
        # errors from the chat request it is mapped onto name this endpoint's fields
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "text"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "bogus": 1}}},
         "text"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 10**7}, "max_output_tokens"),  # the engine's length check, after planning
        ({"input": "word " * 5000}, "input"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
async def test_unsupported_fields_are_400s_naming_them(http: httpx.AsyncClient, extra: dict, param: str) -> None:
    r = await http.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_bad_input_items_are_400s(http: httpx.AsyncClient) -> None:
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]
    for bad in ([], image, [{"type": "function_call_output", "call_id": "c", "output": "x"}], 5):
        r = await http.post("/v1/responses", json={"model": MODEL_NAME, "input": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"].split(".")[0] == "input"  # a wrong type: pydantic's path, input.str


async def test_unknown_model_and_unknown_id_are_404s(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/responses", json={"model": "nope", "input": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert (await http.get("/v1/responses/resp_missing")).status_code == 404
    assert (await http.delete("/v1/responses/resp_missing")).status_code == 404


async def test_stream_frames_carry_event_names(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL_NAME, "input": "Hi", "stream": True, **GREEDY}
    async with http.stream("POST", "/v1/responses", json=body) as r:
        text = "".join([chunk async for chunk in r.aiter_text()])
    frames = [f for f in text.split("\n\n") if f]
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert event_line.removeprefix("event: ") == json.loads(data_line.removeprefix("data: "))["type"]
