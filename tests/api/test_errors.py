"""Every validation failure is a 400 in vLLM's envelope (never 422); unknown model 404; key 401."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.api.conftest import MAX_MODEL_LEN, MODEL_NAME, BackgroundServer

pytestmark = pytest.mark.anyio

OK = {"prompt": "Hello", "max_tokens": 2}

# (body overrides, text the message must contain)
COMPLETION_400 = [
    ({"prompt": ""}, "Either prompt or prompt_embeds must be provided and non-empty."),
    ({"prompt": []}, "Either prompt or prompt_embeds must be provided and non-empty."),
    ({"prompt": [[]]}, "Either prompt or prompt_embeds must be provided and non-empty."),
    ({"prompt": None}, "Either prompt or prompt_embeds must be provided and non-empty."),
    ({"prompt": [1, -5]}, "out of vocabulary"),
    ({"prompt": [1, 10**7]}, "out of vocabulary"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"stream_options": {"include_usage": True}}, "Stream options can only be defined when `stream=True`."),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": 2**63}, "less_than_equal"),
    ({"seed": -(2**63) - 1}, "greater_than_equal"),
    ({"stop": [""]}, "stop cannot contain an empty string"),
    ({"stop_token_ids": [10**8]}, "stop"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"n": 0}, "n"),
    ({"n": "many"}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, "This model's maximum context length is"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "Invalid type"),
    ({"guided_regex": "[a-"}, "regex"),
    ({"structured_outputs": {"choice": []}}, "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "Only one guided"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"suffix": "x"}, "suffix"),
]


def check_envelope(r: httpx.Response, status: int, contains: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    if contains is not None:
        assert contains in err["message"], err["message"]
    return err  # type: ignore[no-any-return]


@pytest.mark.parametrize(("overrides", "message"), COMPLETION_400)
async def test_completion_validation_400(http: httpx.AsyncClient, overrides: dict[str, Any], message: str) -> None:
    r = await http.post("/v1/completions", json={**OK, **overrides})
    err = check_envelope(r, 400, message)
    assert err["type"] == "BadRequestError"


CHAT_400 = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "role"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"logprobs": True, "top_logprobs": 21}, "logprobs"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"max_completion_tokens": MAX_MODEL_LEN}, "This model's maximum context length is"),
    ({"stream_options": {"include_usage": True}}, "Stream options"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
     "--enable-auto-tool-choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "--enable-auto-tool-choice"),
]


@pytest.mark.parametrize(("overrides", "message"), CHAT_400)
async def test_chat_validation_400(http: httpx.AsyncClient, overrides: dict[str, Any], message: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **overrides}
    check_envelope(await http.post("/v1/chat/completions", json=body), 400, message)


# (endpoint, body overrides, the field the error names): the field the client sent, nested keys included
PARAM_400 = [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 10**7}, "max_completion_tokens"),  # the engine's check
    ("/v1/chat/completions", {"max_completion_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object", "schema": {"type": "integer"}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "bogus": 1}}}, "response_format"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": True, "bogus": 1}}, "stream_options"),
    ("/v1/chat/completions", {"structured_outputs": {"choice": "yes"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json_object": "false"}}, "structured_outputs"),
    ("/v1/completions", {"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": ["a"] * 300}, "prompt"),  # more prompts than choices a request may ask for
    # a per-request template is refused as the chat_template field is, and the template call's own arguments
    ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": "X{{ messages[0].content }}"}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize(("path", "overrides", "param"), PARAM_400)
async def test_the_error_names_the_field_sent(http: httpx.AsyncClient, path: str, overrides: dict[str, Any],
                                              param: str) -> None:
    base = OK if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    err = check_envelope(await http.post(path, json={**base, **overrides}), 400)
    assert err["param"] == param, err
    if "max_completion_tokens" in overrides:  # the message names no field that was not sent
        assert "max_tokens" not in err["message"], err


async def test_malformed_and_non_json_bodies(http: httpx.AsyncClient) -> None:
    bad_json = await http.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    check_envelope(bad_json, 400, "not valid JSON")
    form = await http.post("/v1/completions", data={"prompt": "x"})
    check_envelope(form, 400, "application/json")
    not_object = await http.post("/v1/completions", json=["prompt"])
    check_envelope(not_object, 400, "JSON object")
    check_envelope(await http.post("/tokenize", json={"prompt": 5}), 400)
    check_envelope(await http.post("/detokenize", json={"tokens": [-1]}), 400, "out of vocabulary")


async def test_unknown_model_404(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
    err = check_envelope(await http.post("/v1/completions", json={**OK, "model": "gpt-9"}), 404)
    assert err == {
        "message": "The model `gpt-9` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


async def test_unknown_route_uses_the_envelope(http: httpx.AsyncClient) -> None:
    check_envelope(await http.get("/v1/nothing"), 404)
    check_envelope(await http.get("/v1/completions"), 405)


async def test_sdk_raises_bad_request(client: AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, logprobs=21)
    assert info.value.status_code == 400


async def test_api_key_enforced(server: BackgroundServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as anon:
        check_envelope(await anon.post("/v1/completions", json=OK), 401, "Unauthorized")
        check_envelope(await anon.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        # vLLM guards /v1 only: operations endpoints stay open.
        assert (await anon.get("/health")).status_code == 200
        assert (await anon.get("/metrics")).status_code == 200
        assert (await anon.post("/tokenize", json={"prompt": "hi"})).status_code == 200
    bad = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    async with bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
