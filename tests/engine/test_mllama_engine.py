"""Llama 3.2 Vision (Mllama) on the torch backend, tiny random model in fp32: logits equal transformers'
MllamaForConditionalGeneration with one and two images; greedy text through the engine equals transformers'
generate, alone or batched with text requests, in both scheduling modes and with small chunks; prefix caching
keys on the images; n-gram speculation stays exact for image rows."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.core import EngineCore
from nxdserve.engine.loader import build_engine_core
from nxdserve.engine.mm_inputs import ImagePromptProcessor, MultiModalInputs
from nxdserve.engine.outputs import RequestOutput
from nxdserve.errors import InvalidRequestError
from nxdserve.sampling_params import OutputKind, SamplingParams
from tests.helpers.tiny_model import single_torch_thread
from tests.helpers.tiny_vlm import NEW_TOKENS, random_image, run, tiny_mllama_path, tokens

TEXTS = {
    0: "Say something about it.",
    1: "Look at this: <|image|> and describe it.",
    2: "First <|image|> then <|image|> compare.",
}
# (width, height): 2 tiles side by side, 1 tile, 2 tiles stacked.
IMAGE_SIZES = [(56, 28), (28, 28), (20, 50)]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    with single_torch_thread():
        yield


@cache
def processor() -> ImagePromptProcessor:
    from transformers import AutoConfig

    path = tiny_mllama_path()
    return ImagePromptProcessor(path, int(AutoConfig.from_pretrained(str(path)).image_token_id))


@cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_mllama_path()))


def prompt(num_images: int, first_image: int = 0, text: str | None = None) -> tuple[list[int], MultiModalInputs | None]:
    ids = list(tokenizer().encode(TEXTS[num_images] if text is None else text))
    if not num_images:
        return ids, None
    images = [random_image(*IMAGE_SIZES[i % 3], seed=i) for i in range(first_image, first_image + num_images)]
    return processor().process(ids, images)


@cache
def reference_model() -> Any:
    from transformers import MllamaForConditionalGeneration

    return MllamaForConditionalGeneration.from_pretrained(str(tiny_mllama_path()), dtype=torch.float32).eval()


def reference_inputs(ids: list[int], mm: MultiModalInputs | None) -> dict[str, Any]:
    """What MllamaProcessor gives transformers for the same prompt (its cross_attention_mask from transformers'
    own functions)."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    inputs: dict[str, Any] = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids)).long()}
    if mm is None:
        return inputs
    assert mm.num_tiles is not None and mm.aspect_ratio_ids is not None and mm.aspect_ratio_mask is not None
    spans = get_cross_attention_token_mask(ids, processor().image_token_id)
    mask = convert_sparse_cross_attention_mask_to_dense([spans], [list(mm.num_tiles)], 2, len(ids))
    inputs.update(
        pixel_values=mm.pixel_values[None], aspect_ratio_ids=mm.aspect_ratio_ids[None],
        aspect_ratio_mask=mm.aspect_ratio_mask[None], cross_attention_mask=torch.from_numpy(mask),
    )  # fmt: skip
    return inputs


@cache
def _reference_tokens(key: tuple[Any, ...]) -> list[int]:
    ids, mm = _pending[key]
    with torch.no_grad():
        out = reference_model().generate(
            **reference_inputs(ids, mm), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


_pending: dict[tuple[Any, ...], tuple[list[int], MultiModalInputs | None]] = {}


def reference_tokens(ids: list[int], mm: MultiModalInputs | None) -> list[int]:
    """transformers' greedy generate on the same processor inputs (memoised per prompt and images)."""
    key = (tuple(ids), None if mm is None else mm.image_hashes)
    _pending[key] = (ids, mm)
    return _reference_tokens(key)


def make_core(**overrides: Any) -> EngineCore:
    settings: dict[str, Any] = {"model": str(tiny_mllama_path()), "backend": "torch", "dtype": "float32",
                                "max_model_len": 128, "max_num_seqs": 4}  # fmt: skip
    settings.update(overrides)
    core, _ = build_engine_core(EngineConfig(**settings), with_metrics=False)
    return core


@cache
def shared_core(mode: str) -> EngineCore:
    if mode == "prefill-first":
        return make_core(enable_chunked_prefill=False)
    if mode == "small-chunks":  # 3-token chunks: the image token and the text around it land in different steps
        return make_core(enable_chunked_prefill=True, max_num_batched_tokens=4, long_prefill_token_threshold=3)
    return make_core(enable_chunked_prefill=True)


def test_processor_keeps_one_image_token_per_image() -> None:
    ids, mm = prompt(2)
    assert mm is not None and mm.cross_attention
    assert ids == tokenizer().encode(TEXTS[2])  # no expansion
    image_id = processor().image_token_id
    assert mm.num_image_tokens == (1, 1) and [ids[o] for o in mm.image_offsets] == [image_id, image_id]
    assert mm.num_tiles == (2, 1) and mm.pixel_values.shape == (2, 2, 3, 28, 28)  # padded to 2 tiles
    assert mm.image_grid_thw.tolist() == [[1, 1, 2], [1, 1, 1]]  # tiles: (1, rows, columns)
    _, tall = processor().process(tokenizer().encode(TEXTS[1]), [random_image(20, 50, 2)])
    assert tall.image_grid_thw.tolist() == [[1, 2, 1]]
    with pytest.raises(InvalidRequestError, match="image token"):
        processor().process(tokenizer().encode(TEXTS[1]), [random_image(28, 28, 0)] * 2)


@pytest.mark.parametrize("num_images", [1, 2])
def test_prefill_logits_equal_transformers(num_images: int) -> None:
    from nxdserve.engine.models.mllama import MllamaModel

    model = MllamaModel.from_pretrained(tiny_mllama_path(), torch.float32, torch.device("cpu")).eval()
    ids, mm = prompt(num_images)
    with torch.no_grad():
        expected = reference_model()(**reference_inputs(ids, mm)).logits[0]
        text_only = reference_model()(**reference_inputs(ids, None)).logits[0]
    ours = model.prefill_logits(ids, mm)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.prefill_logits(ids, None), text_only, rtol=1e-4, atol=1e-4)
    assert (expected - text_only).abs().max() > 0.1  # the images change the logits, before the image token too
    assert (expected[0] - text_only[0]).abs().max() > 1e-3


@pytest.mark.parametrize("num_images", [1, 2])
def test_greedy_text_equals_transformers(num_images: int) -> None:
    ids, mm = prompt(num_images)
    (out,) = run(shared_core("chunked"), [(ids, mm)])
    assert tokens(out) == reference_tokens(ids, mm)
    assert len(out.prompt_token_ids) == len(ids)  # one token per image, as vLLM counts Mllama prompts


@pytest.mark.parametrize("mode", ["chunked", "prefill-first", "small-chunks"])
def test_mixed_batch_gives_each_request_its_output_alone(mode: str) -> None:
    prompts = [prompt(0), prompt(1), prompt(2, first_image=1), prompt(1, first_image=2)]
    expected = [reference_tokens(ids, mm) for ids, mm in prompts]
    core = shared_core(mode)
    outs = run(core, prompts)
    assert [tokens(o) for o in outs] == expected
    assert expected[1] != expected[3]  # the same tokens with another image: other text (the images reach it)


def test_prefix_caching_keys_on_the_images() -> None:
    """The text before an Mllama image attends to it (transformers' full text rows), so even that text's KV is
    only reused behind the same images."""
    core = make_core(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_seqs=1)
    text = "A long shared preamble that fills more than one block of tokens, " * 2 + "<|image|> then the question."
    ids_a, mm_a = processor().process(list(tokenizer().encode(text)), [random_image(56, 28, seed=0)])
    ids_b, mm_b = processor().process(list(tokenizer().encode(text)), [random_image(56, 28, seed=7)])
    requests: list[Any] = []
    (first,) = run(core, [(ids_a, mm_a)], requests)
    (other,) = run(core, [(ids_b, mm_b)], requests)
    assert requests[1].num_cached_tokens == 0
    assert tokens(other) == reference_tokens(ids_b, mm_b) and tokens(other) != tokens(first)
    (same,) = run(core, [(ids_b, mm_b)], requests)  # the same image again: its KV is reused past the image
    assert requests[2].num_cached_tokens > mm_b.image_offsets[0]
    assert tokens(same) == tokens(other)
    (plain,) = run(core, [(ids_b[: mm_b.image_offsets[0]], None)], requests)  # text only: no image KV reused
    assert requests[3].num_cached_tokens == 0
    assert tokens(plain) == reference_tokens(ids_b[: mm_b.image_offsets[0]], None)


def test_ngram_speculation_keeps_image_requests_exact() -> None:
    """Speculative decoding stays on for image rows: verification runs the cross-attention layers too."""
    core = make_core(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                         "prompt_lookup_min": 1})  # fmt: skip
    prompts = [prompt(1), prompt(0), prompt(2, first_image=1)]
    assert [tokens(o) for o in run(core, prompts)] == [reference_tokens(ids, mm) for ids, mm in prompts]


def test_a_recurring_image_is_encoded_once_per_admitting_step() -> None:
    core = make_core()
    image = random_image(56, 28, seed=3)
    twice = processor().process(list(tokenizer().encode(TEXTS[2])), [image, image])
    once = processor().process(list(tokenizer().encode(TEXTS[1])), [image])
    backend: Any = core.backend
    before = backend.vlm.num_images_encoded
    outs = run(core, [twice, once])  # admitted in the same step
    assert backend.vlm.num_images_encoded - before == 1
    assert [tokens(o) for o in outs] == [reference_tokens(*twice), reference_tokens(*once)]


def test_bf16_text_steps_take_the_fused_forward_and_image_steps_the_layer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps without image rows skip the cross-attention layers, so the fused C forward (self-attention layers
    only) runs them; steps with image rows take the layer path. Tokens equal the layer path's throughout."""
    from nxdserve.engine.models import fused_decode

    if not fused_decode.available():
        pytest.skip("the fused C forward is not built on this machine")
    core = make_core(dtype="bfloat16")
    fused_calls = 0
    real_run = fused_decode.FusedDecode.run

    def counting_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal fused_calls
        fused_calls += 1
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(fused_decode.FusedDecode, "run", counting_run)
    (text,) = run(core, [prompt(0)])
    assert fused_calls >= NEW_TOKENS - 1
    fused_calls = 0
    mixed = [tokens(o) for o in run(core, [prompt(1), prompt(0)])]
    assert fused_calls == 0  # an image row in every step
    monkeypatch.setattr(fused_decode, "enabled", False)
    assert tokens(run(core, [prompt(0)])[0]) == tokens(text)
    assert [tokens(o) for o in run(core, [prompt(1), prompt(0)])] == mixed


@pytest.mark.anyio
async def test_async_engine_generate_takes_vllm_multimodal_dicts() -> None:
    from nxdserve.engine.async_engine import AsyncEngine

    config = EngineConfig(model=str(tiny_mllama_path()), backend="torch", dtype="float32", max_model_len=128,
                          max_num_seqs=2)  # fmt: skip
    images = [random_image(*IMAGE_SIZES[0], seed=0)]
    ids, mm = prompt(1)
    async with AsyncEngine(config) as engine:
        assert engine.accepts_images
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        params.output_kind = OutputKind.FINAL_ONLY
        finals = []
        for form in (
            {"prompt": TEXTS[1], "multi_modal_data": {"image": images[0]}},
            {"prompt_token_ids": tokenizer().encode(TEXTS[1]), "multi_modal_data": {"image": images}},
        ):
            async for out in engine.generate(form, SamplingParams(**vars(params))):
                final = out
            finals.append(final)
        with pytest.raises(InvalidRequestError, match="image token"):
            async for _ in engine.generate({"prompt": "no image token", "multi_modal_data": {"image": images}}):
                pass
        async for out in engine.generate(TEXTS[0], SamplingParams(**vars(params))):  # still serving
            final = out
    expected = reference_tokens(ids, mm)
    assert [tokens(f) for f in finals] == [expected, expected]
    assert all(len(f.prompt_token_ids) == len(ids) for f in finals)
    assert tokens(final) == reference_tokens(*prompt(0))


def test_a_preempted_image_request_resumes_with_its_cross_attention_states() -> None:
    """Priority preemption frees the slot (and its cross-attention states); the resumed request is admitted again,
    its images encoded again, and its text equals the text alone."""
    core = make_core(scheduling_policy="priority", max_num_seqs=1, enable_chunked_prefill=True)
    ids, mm = prompt(2, first_image=1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    params.output_kind = OutputKind.FINAL_ONLY
    image_request = core.make_request(ids, params, priority=5)
    image_request.mm_inputs = mm
    core.add_request(image_request)
    finals: dict[str, RequestOutput] = {}
    for _ in range(3):  # the prompt and two tokens
        core.step()
    urgent = core.make_request(prompt(0)[0], SamplingParams(**vars(params)), priority=0)
    core.add_request(urgent)
    backend: Any = core.backend
    before = backend.vlm.num_images_encoded
    while core.has_unfinished:
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
    assert core.scheduler.num_preemptions_total == 1
    assert backend.vlm.num_images_encoded - before == 2  # its two images again, at re-admission
    assert tokens(finals[image_request.request_id]) == reference_tokens(ids, mm)
    assert tokens(finals[urgent.request_id]) == reference_tokens(*prompt(0))


def test_lora_is_refused_at_start_up() -> None:
    from nxdserve.errors import ConfigError

    with pytest.raises(ConfigError, match="enable-lora"):
        make_core(enable_lora=True)
