"""Images through the server to Mllama (tiny random Llama 3.2 Vision, fp32, torch backend): chat completions with
data: URL images give transformers' greedy text on the same processor inputs, usage counts one prompt token per
image (as vLLM counts Mllama prompts), and a bad image is a 400 that leaves the engine serving."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from nxdserve.api.server import BackgroundServer
from tests.api.conftest import API_KEY, MODEL_NAME, start_server
from tests.engine.test_mllama_engine import NEW_TOKENS, processor, reference_tokens, tokenizer
from tests.helpers.tiny_vlm import data_url, random_image, tiny_mllama_path

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def mllama_server() -> Iterator[BackgroundServer]:
    server = start_server(api_key=API_KEY, model=str(tiny_mllama_path()), max_model_len=128, max_num_seqs=4)
    yield server
    server.stop()


@pytest.fixture
async def http(mllama_server: BackgroundServer) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=mllama_server.url, headers=headers, timeout=120) as c:
        yield c


def chat_body(content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip


def expected(content: list[dict[str, Any]], images: list[Any]) -> tuple[str, int]:
    """(transformers' greedy text, prompt tokens) for the same chat: the template, then the processor."""
    template_parts = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
    text = tokenizer().apply_chat_template(
        [{"role": "user", "content": template_parts}], add_generation_prompt=True, tokenize=False
    )
    ids = list(tokenizer().encode(text))
    mm = None
    if images:
        ids, mm = processor().process(ids, images)
    return tokenizer().decode(reference_tokens(ids, mm), skip_special_tokens=True), len(ids)


async def test_chat_with_an_image_equals_transformers(http: httpx.AsyncClient) -> None:
    image = random_image(56, 28, seed=11)
    content: list[dict[str, Any]] = [
        {"type": "text", "text": "Describe"},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "briefly."},
    ]
    response = await http.post("/v1/chat/completions", json=chat_body(content))
    assert response.status_code == 200, response.text
    body = response.json()
    text, num_prompt = expected(content, [image])
    assert body["choices"][0]["message"]["content"] == text
    assert body["usage"]["prompt_tokens"] == num_prompt  # the <|image|> token counts once
    assert body["usage"]["completion_tokens"] == NEW_TOKENS


async def test_bad_image_is_a_400_and_the_engine_keeps_serving(http: httpx.AsyncClient) -> None:
    broken = [
        {"type": "text", "text": "Look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    response = await http.post("/v1/chat/completions", json=chat_body(broken))
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].content[1]"
    image = random_image(20, 50, seed=12)
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "What?"}]
    response = await http.post("/v1/chat/completions", json=chat_body(content))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == expected(content, [image])[0]
    text_only = [{"type": "text", "text": "Say something."}]
    response = await http.post("/v1/chat/completions", json=chat_body(text_only))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == expected(text_only, [])[0]
