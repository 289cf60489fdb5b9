"""/v1/chat/completions against the real server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.api.conftest import MODEL_NAME, sse_events

pytestmark = pytest.mark.anyio

MESSAGES: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]


async def test_chat_usage_matches_tokenize(any_client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
    resp = await any_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.id.startswith("chatcmpl-")
    assert resp.object == "chat.completion"
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content
    tokenized = (await http.post("/tokenize", json={"messages": MESSAGES})).json()
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == tokenized["count"]
    assert resp.usage.completion_tokens == 4
    assert resp.choices[0].finish_reason == "length"


async def test_chat_stream_equals_non_stream(any_client: AsyncOpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    full = await any_client.chat.completions.create(**kwargs)
    stream = await any_client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


async def test_chat_roles_parts_and_template_options(client: AsyncOpenAI) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
        {"role": "assistant", "content": "Blue."},
        {"role": "tool", "content": "ok", "tool_call_id": "call_1"},
        {"role": "user", "content": "Another one?"},
    ]
    resp = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0)
    assert resp.choices[0].message.content
    cont = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[*MESSAGES, {"role": "assistant", "content": "The capital of France is"}],
        max_tokens=2,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {}},
    )
    assert cont.choices[0].message.content


async def test_chat_logprobs_top_counts(client: AsyncOpenAI) -> None:
    resp = await client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs and resp.choices[0].logprobs.content
    assert content is not None and len(content) == resp.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for tok in content:
        assert len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[-1].logprob
        assert tok.bytes == list(tok.token.encode())
    plain = await client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature=0, logprobs=True
    )
    assert plain.choices[0].logprobs is not None
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content or [])


async def test_chat_n2_stream_interleaved(http: httpx.AsyncClient) -> None:
    body = {"messages": MESSAGES, "max_tokens": 3, "n": 2, "seed": 5, "temperature": 1, "stream": True}
    r = await http.post("/v1/chat/completions", json=body)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


async def test_chat_rejections(client: AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="response_format"):
        await client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=2, response_format={"type": "xml"}  # type: ignore[arg-type]
        )
    with pytest.raises(openai.BadRequestError, match="image_url"):
        await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
            max_tokens=2,
        )
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, top_logprobs=2)
    text_format = await client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=1, response_format={"type": "text"}
    )
    assert text_format.choices[0].message.content is not None
