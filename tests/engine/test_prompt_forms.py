"""AsyncEngine.generate's prompt forms (vLLM's dict prompts with multi_modal_data) and their refusals."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from nxdserve import AsyncEngine, EngineConfig, InvalidRequestError, SamplingParams
from nxdserve.engine.prompts import parse_prompt
from nxdserve.sampling_params import OutputKind

pytestmark = pytest.mark.anyio


def red_image() -> Any:
    from PIL import Image

    return Image.new("RGB", (8, 8), (255, 0, 0))


def test_parse_prompt_forms() -> None:
    assert (parse_prompt("hi").text, parse_prompt("hi").token_ids) == ("hi", None)
    assert parse_prompt([1, 2]).token_ids == [1, 2]
    assert parse_prompt({"prompt_token_ids": (3, 4)}).token_ids == [3, 4]
    image = red_image()
    parsed = parse_prompt({"prompt": "look", "multi_modal_data": {"image": [image, image]}})
    assert parsed.text == "look" and parsed.images == [image, image]
    assert parse_prompt({"prompt": "x", "multi_modal_data": {"image": image}}).images == [image]


@pytest.mark.parametrize(
    ("prompt", "param"),
    [({"prompt": "x", "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
     ({"prompt": "x", "prompt_token_ids": [1]}, "prompt"), ({}, "prompt"), ({"prompt": 5}, "prompt"),
     ({"prompt_token_ids": "12"}, "prompt_token_ids"),
     ({"prompt": "x", "multi_modal_data": {"video": []}}, "multi_modal_data.video"),
     ({"prompt": "x", "multi_modal_data": {"image": [b"png"]}}, "multi_modal_data.image[0]"),
     ({"prompt": "x", "multi_modal_data": ["img"]}, "multi_modal_data"), (3.5, "prompt")],
)
def test_bad_prompts_name_the_field(prompt: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_prompt(prompt)
    assert info.value.param == param


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(EngineConfig(dtype="float32", backend="torch", max_model_len=128, max_num_seqs=2)) as eng:
        yield eng


async def _tokens(engine: AsyncEngine, prompt: Any) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
    [out] = [o async for o in engine.generate(prompt, params)]
    return list(out.outputs[0].token_ids)


async def test_dict_prompts_generate_as_their_plain_forms(engine: AsyncEngine) -> None:
    text = "The capital of France is"
    ids = engine.encode(text)
    plain = await _tokens(engine, text)
    assert await _tokens(engine, {"prompt": text}) == plain
    assert await _tokens(engine, {"prompt_token_ids": ids}) == await _tokens(engine, ids) == plain


async def test_images_for_a_text_model_are_refused_and_the_engine_keeps_serving(engine: AsyncEngine) -> None:
    assert engine.accepts_images is False
    with pytest.raises(InvalidRequestError, match="text-only") as info:
        await _tokens(engine, {"prompt": "What is this?", "multi_modal_data": {"image": red_image()}})
    assert info.value.param == "multi_modal_data"
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0
    assert len(await _tokens(engine, "Still here?")) == 4
