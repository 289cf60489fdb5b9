"""/v1/completions against the real server, through the OpenAI SDK and raw httpx."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import AsyncOpenAI

from tests.api.conftest import MODEL_NAME, sse_events

pytestmark = pytest.mark.anyio

PROMPT = "The capital of France is"


async def count_tokens(http: httpx.AsyncClient, prompt: str) -> int:
    r = await http.post("/tokenize", json={"prompt": prompt})
    return int(r.json()["count"])


async def test_usage_counts_are_exact(any_client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
    resp = await any_client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.id.startswith("cmpl-")
    assert resp.object == "text_completion"
    assert resp.model == MODEL_NAME
    [choice] = resp.choices
    assert choice.finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == await count_tokens(http, PROMPT)
    assert resp.usage.completion_tokens == 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 5


async def test_stream_equals_non_stream(any_client: AsyncOpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    full = await any_client.completions.create(**kwargs)
    stream = await any_client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    text, finishes, chunks = "", [], []
    async for chunk in stream:
        chunks.append(chunk)
        for c in chunk.choices:
            text += c.text
            if c.finish_reason is not None:
                finishes.append(c.finish_reason)
    assert text == full.choices[0].text
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert {c.id for c in chunks} == {chunks[0].id}


async def test_raw_sse_framing(http: httpx.AsyncClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = (await r.aread()).decode()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_n3_with_seed_is_reproducible(client: AsyncOpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "n": 3, "seed": 1234}
    first = await client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    second = await client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage is not None
    assert first.usage.completion_tokens == 3 * 6
    assert len({c.text for c in first.choices}) > 1  # child i is seeded with seed + i


async def test_n3_stream_one_finish_reason_per_choice(client: AsyncOpenAI) -> None:
    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=5,
        temperature=1.0,
        n=3,
        seed=7,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts, finishes = ["", "", ""], [0, 0, 0]
    async for chunk in stream:
        assert len(chunk.choices) == 1  # one choice per chunk, interleaved by index
        c = chunk.choices[0]
        texts[c.index] += c.text
        if c.finish_reason is not None:
            finishes[c.index] += 1
    assert finishes == [1, 1, 1]
    assert all(texts)


async def test_logprobs_counts(client: AsyncOpenAI) -> None:
    resp = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == resp.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4  # the top 3 plus the chosen token when it is not among them
        assert top[token] == pytest.approx(value)
        assert value <= 0


async def test_echo_with_logprobs_includes_prompt(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
    resp = await client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True
    )
    choice = resp.choices[0]
    assert choice.text.startswith(PROMPT)
    n_prompt = await count_tokens(http, PROMPT)
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == n_prompt + 3
    assert choice.logprobs.token_logprobs[0] is None  # the first prompt token has no logprob


async def test_echo_with_zero_max_tokens_returns_the_prompt(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == PROMPT
    assert body["usage"]["completion_tokens"] == 0


async def test_prompt_shapes(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
    ids = (await http.post("/tokenize", json={"prompt": PROMPT})).json()["tokens"]
    by_text = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    by_ids = await client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = await client.completions.create(
        model=MODEL_NAME, prompt=[PROMPT, "Hello, my name is"], max_tokens=3, temperature=0, n=2
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == len(ids) + await count_tokens(http, "Hello, my name is")
    id_batch = await client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:2]], max_tokens=2, temperature=0)
    assert len(id_batch.choices) == 2


async def test_stop_strings(client: AsyncOpenAI) -> None:
    base = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    text = base.choices[0].text
    assert "." in text, text  # " Paris.\n\nThe..." with this model
    cut = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, stop=["."])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text.split(".")[0]
    kept = await client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stop=".",
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == text.split(".")[0] + "."


async def test_continuous_usage_stats(http: httpx.AsyncClient) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    r = await http.post("/v1/completions", json=body)
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert all(c["usage"] is not None for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == [1, 2, 3]
    assert chunks[-1]["choices"] == []


async def test_request_id_header_is_honoured(http: httpx.AsyncClient) -> None:
    r = await http.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers={"X-Request-Id": "my-id-1"}
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "my-id-1"
    assert r.json()["id"] == "cmpl-my-id-1"


async def test_request_id_field_names_the_response(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "request_id": "body-7"})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "cmpl-body-7"
    r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 1, "request_id": "body-8"})
    assert r.json()["id"] == "chatcmpl-body-8"
    # The header wins over the body (vLLM's order).
    r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "request_id": "body-9"},
                        headers={"X-Request-Id": "head-9"})
    assert r.json()["id"] == "cmpl-head-9"


async def test_unknown_fields_are_400s_naming_them(http: httpx.AsyncClient) -> None:
    """As OpenAI's API does: a misspelt field must not look honoured (vLLM only logs it)."""
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        r = await http.post(path, json={**body, "max_tokens": 1, "temprature": 0.5})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "temprature" and "temprature" in error["message"]


@pytest.mark.parametrize(("field", "accepted", "refused"), [
    ("store", False, True),
    ("service_tier", "auto", "flex"),
    ("modalities", ["text"], ["text", "audio"]),
    ("include_reasoning", True, False),
])
async def test_openai_no_op_fields_accept_only_their_no_op_values(
    http: httpx.AsyncClient, field: str, accepted: object, refused: object
) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    r = await http.post("/v1/chat/completions", json={**body, field: accepted})
    assert r.status_code == 200, r.text
    r = await http.post("/v1/chat/completions", json={**body, field: refused})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


async def test_labels_and_hints_are_accepted(http: httpx.AsyncClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "metadata": {"team": "a"}, "prompt_cache_key": "k",
            "safety_identifier": "u1", "user": "u1"}
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


async def test_chat_refuses_the_fields_only_completions_implement(http: httpx.AsyncClient) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    for field, value in (("echo", True), ("prompt_logprobs", 1), ("return_token_ids", True)):
        r = await http.post("/v1/chat/completions", json={**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = await http.post("/v1/chat/completions", json={**body, "echo": False})  # unset in effect
    assert r.status_code == 200, r.text


async def test_vllm_extra_params(client: AsyncOpenAI) -> None:
    resp = await client.completions.create(
        model="smol-alias",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={"7042": -100},
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "stop_token_ids": [2],
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
        },
    )
    assert resp.model == MODEL_NAME  # an alias answers as the first served name (vLLM's base_model_paths[0])
    assert resp.usage is not None and 2 <= resp.usage.completion_tokens <= 4
    assert not resp.choices[0].text.startswith(" Paris")  # token 7042 is " Paris", biased away


async def test_tokenize_refuses_unknown_fields(http: httpx.AsyncClient) -> None:
    r = await http.post("/tokenize", json={"prompt": "hi", "chat_template": "{{ x }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    r = await http.post("/detokenize", json={"tokens": [1, 2], "skip_special": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special", r.text
    assert (await http.post("/tokenize", json={"prompt": "hi"})).status_code == 200
