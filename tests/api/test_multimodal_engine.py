"""Images through the server to a vision-language model (tiny random Qwen2-VL, fp32, torch backend): chat
completions with data: URL images give transformers' greedy text on the same processor inputs, usage counts the
image tokens, and a bad image is a 400 that leaves the engine serving."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from nxdserve.api.server import BackgroundServer
from tests.api.conftest import API_KEY, MODEL_NAME, start_server
from tests.engine.test_qwen2_vl_engine import NEW_TOKENS, processor, reference_tokens, tokenizer
from tests.helpers.tiny_vlm import data_url, random_image, tiny_qwen2_vl_path

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def vlm_server() -> Iterator[BackgroundServer]:
    server = start_server(api_key=API_KEY, model=str(tiny_qwen2_vl_path()), max_model_len=128, max_num_seqs=4)
    yield server
    server.stop()


@pytest.fixture
async def http(vlm_server: BackgroundServer) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=vlm_server.url, headers=headers, timeout=120) as c:
        yield c


def chat_body(content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip


def expected(content: list[dict[str, Any]], images: list[Any]) -> tuple[list[int], int]:
    """(transformers' greedy tokens, prompt tokens) for the same chat: the template, then the processor."""
    template_parts = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
    text = tokenizer().apply_chat_template(
        [{"role": "user", "content": template_parts}], add_generation_prompt=True, tokenize=False
    )
    ids = list(tokenizer().encode(text))
    if not images:
        return reference_tokens(ids, None), len(ids)
    ids, mm = processor().process(ids, images)
    return reference_tokens(ids, mm), len(ids)


@pytest.mark.parametrize("num_images", [1, 2])
async def test_chat_with_images_equals_transformers(http: httpx.AsyncClient, num_images: int) -> None:
    images = [random_image(112, 112 - 28 * i, seed=10 + i) for i in range(num_images)]
    content: list[dict[str, Any]] = [{"type": "text", "text": "Compare these:"}]
    for image in images:
        content += [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "and"}]
    response = await http.post("/v1/chat/completions", json=chat_body(content))
    assert response.status_code == 200, response.text
    body = response.json()
    tokens, num_prompt = expected(content, images)
    assert body["choices"][0]["message"]["content"] == tokenizer().decode(tokens, skip_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == num_prompt  # the image tokens count, as in vLLM
    assert body["usage"]["completion_tokens"] == NEW_TOKENS


async def test_tokenize_counts_the_image_tokens_as_chat_usage_does(http: httpx.AsyncClient) -> None:
    image = random_image(112, 84, seed=3)
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    response = await http.post("/tokenize", json={"model": MODEL_NAME, "add_generation_prompt": True,
                                                  "messages": [{"role": "user", "content": content}]})
    assert response.status_code == 200, response.text
    assert response.json()["count"] == expected(content, [image])[1]
    broken = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    messages = [{"role": "user", "content": broken}]
    response = await http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].content[0]"


async def test_bad_image_is_a_400_and_the_engine_keeps_serving(http: httpx.AsyncClient) -> None:
    broken = [
        {"type": "text", "text": "Look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    response = await http.post("/v1/chat/completions", json=chat_body(broken))
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].content[1]"
    # An image the processor refuses (an aspect ratio over 200) is a 400 too, naming the images.
    thin = [{"type": "image_url", "image_url": {"url": data_url(random_image(2000, 8, seed=1))}}]
    response = await http.post("/v1/chat/completions", json=chat_body(thin))
    assert response.status_code == 400 and "multi_modal_data.image" in response.json()["error"]["param"]
    text_only = [{"type": "text", "text": "Say something."}]
    response = await http.post("/v1/chat/completions", json=chat_body(text_only))
    assert response.status_code == 200
    tokens, _ = expected(text_only, [])
    assert response.json()["choices"][0]["message"]["content"] == tokenizer().decode(tokens, skip_special_tokens=True)
