"""Image requests through the engine (torch backend, tiny random Qwen2-VL, fp32): greedy text equals
transformers' generate, alone or batched with text requests, in both scheduling modes, with chunks that cut
through image tokens, with n-gram speculation, and prefix caching never shares KV across different images."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.core import EngineCore
from nxdserve.engine.loader import build_engine_core
from nxdserve.engine.mm_inputs import ImagePromptProcessor, MultiModalInputs
from nxdserve.errors import InvalidRequestError
from nxdserve.sampling_params import OutputKind, SamplingParams
from tests.helpers.tiny_model import single_torch_thread
from tests.helpers.tiny_vlm import NEW_TOKENS, random_image, run, tiny_qwen2_vl_path, tokens

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
TEXTS = {
    0: "Say something.",
    1: f"Look: {PAD} and describe it.",
    2: f"First {PAD} then {PAD} compare.",
}
# (width, height): 16 and 12 image tokens, 6 for the small one.
IMAGE_SIZES = [(112, 112), (112, 84), (56, 84)]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    with single_torch_thread():
        yield


@cache
def processor() -> ImagePromptProcessor:
    from transformers import AutoConfig

    path = tiny_qwen2_vl_path()
    return ImagePromptProcessor(path, int(AutoConfig.from_pretrained(str(path)).image_token_id))


@cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_qwen2_vl_path()))


def prompt(num_images: int, first_image: int = 0) -> tuple[list[int], MultiModalInputs | None]:
    ids = list(tokenizer().encode(TEXTS[num_images]))
    if not num_images:
        return ids, None
    images = [random_image(*IMAGE_SIZES[i % 3], seed=i) for i in range(first_image, first_image + num_images)]
    return processor().process(ids, images)


@cache
def reference_model() -> Any:
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(tiny_qwen2_vl_path()), dtype=torch.float32).eval()


def reference_tokens(ids: list[int], mm: MultiModalInputs | None) -> list[int]:
    """transformers' greedy generate on the same processor inputs."""
    input_ids = torch.tensor([ids])
    extra: dict[str, Any] = {}
    if mm is not None:
        image_id = processor().image_token_id
        extra = {"pixel_values": mm.pixel_values, "image_grid_thw": mm.image_grid_thw,
                 "mm_token_type_ids": (input_ids == image_id).int()}  # fmt: skip
    with torch.no_grad():
        out = reference_model().generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0, **extra,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def make_core(**overrides: Any) -> EngineCore:
    settings: dict[str, Any] = {"model": str(tiny_qwen2_vl_path()), "backend": "torch", "dtype": "float32",
                                "max_model_len": 128, "max_num_seqs": 4}  # fmt: skip
    settings.update(overrides)
    core, _ = build_engine_core(EngineConfig(**settings), with_metrics=False)
    return core


def test_processor_expands_placeholders_as_transformers_processor_does() -> None:
    ids, mm = prompt(2)
    assert mm is not None
    # Qwen2VLProcessor.__call__ repeats each <|image_pad|> grid.prod() // merge**2 times, then tokenizes.
    text = TEXTS[2]
    for n in mm.num_image_tokens:
        text = text.replace("<|image_pad|>", "<|IMG|>" * n, 1)
    expected = tokenizer().encode(text.replace("<|IMG|>", "<|image_pad|>"))
    assert ids == expected
    assert mm.num_image_tokens == (16, 12)
    image_id = processor().image_token_id
    assert [ids[o] for o in mm.image_offsets] == [image_id, image_id]
    assert ids[mm.image_offsets[1] - 1] != image_id
    # Already expanded placeholders are kept; a wrong count or a missing placeholder is a clear error.
    again, _ = processor().process(ids, [random_image(112, 112, 0), random_image(112, 84, 1)])
    assert again == ids
    with pytest.raises(InvalidRequestError, match="placeholder"):
        processor().process(tokenizer().encode(TEXTS[1]), [random_image(112, 112, 0)] * 2)


@pytest.mark.parametrize("num_images", [1, 2])
def test_greedy_text_equals_transformers(num_images: int) -> None:
    ids, mm = prompt(num_images)
    (out,) = run(shared_core("chunked"), [(ids, mm)])
    assert tokens(out) == reference_tokens(ids, mm)
    assert len(out.prompt_token_ids) == len(ids)  # image tokens count as prompt tokens, as vLLM counts them


@cache
def shared_core(mode: str) -> EngineCore:
    if mode == "prefill-first":
        return make_core(enable_chunked_prefill=False)
    if mode == "small-chunks":  # 5-token chunks: every image's tokens are cut across steps
        return make_core(enable_chunked_prefill=True, max_num_batched_tokens=5, long_prefill_token_threshold=5)
    return make_core(enable_chunked_prefill=True)


@pytest.mark.parametrize("mode", ["chunked", "prefill-first", "small-chunks"])
def test_mixed_batch_gives_each_request_its_output_alone(mode: str) -> None:
    prompts = [prompt(0), prompt(1), prompt(2, first_image=1), prompt(1, first_image=2)]
    expected = [reference_tokens(ids, mm) for ids, mm in prompts]
    core = shared_core(mode)
    if mode == "small-chunks":
        assert core.config.max_num_batched_tokens == 5
    outs = run(core, prompts)
    assert [tokens(o) for o in outs] == expected
    # Different images behind the same tokens give different text (the images reach the model).
    assert expected[1] != expected[3] or prompts[1][0] != prompts[3][0]


def test_prefix_caching_never_shares_kv_across_images() -> None:
    core = make_core(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_seqs=1)
    ids_a, mm_a = prompt(1, first_image=0)
    ids_b, mm_b = processor().process(list(tokenizer().encode(TEXTS[1])), [random_image(112, 112, seed=7)])
    assert ids_a == ids_b and mm_a is not None and mm_b is not None  # same tokens, different image
    requests: list[Any] = []
    (first,) = run(core, [(ids_a, mm_a)], requests)
    (other,) = run(core, [(ids_b, mm_b)], requests)
    assert tokens(other) == reference_tokens(ids_b, mm_b)
    assert tokens(other) != tokens(first)
    assert 0 < requests[1].num_cached_tokens <= mm_b.image_offsets[0]  # the text before the image only
    (same,) = run(core, [(ids_b, mm_b)], requests)  # the same image again: its KV is reused past the image
    assert tokens(same) == tokens(other)
    assert requests[2].num_cached_tokens > mm_b.image_offsets[0] + mm_b.num_image_tokens[0]


def test_ngram_speculation_keeps_image_requests_exact() -> None:
    core = make_core(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                         "prompt_lookup_min": 1})  # fmt: skip
    prompts = [prompt(1), prompt(0), prompt(2, first_image=1)]
    assert [tokens(o) for o in run(core, prompts)] == [reference_tokens(ids, mm) for ids, mm in prompts]


@pytest.mark.anyio
async def test_async_engine_generate_takes_vllm_multimodal_dicts() -> None:
    from nxdserve.engine.async_engine import AsyncEngine

    config = EngineConfig(model=str(tiny_qwen2_vl_path()), backend="torch", dtype="float32", max_model_len=128,
                          max_num_seqs=2)  # fmt: skip
    images = [random_image(112, 112, seed=0)]
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
        with pytest.raises(InvalidRequestError, match="placeholder"):
            async for _ in engine.generate({"prompt": "no placeholder", "multi_modal_data": {"image": images}}):
                pass
        with pytest.raises(InvalidRequestError, match="process_prompt"):  # the processor never runs on the loop
            engine.add_request({"prompt": TEXTS[1], "multi_modal_data": {"image": images}}, SamplingParams())
    expected = reference_tokens(ids, mm)
    assert [tokens(f) for f in finals] == [expected, expected]
    assert all(len(f.prompt_token_ids) == len(ids) for f in finals)


def test_bf16_fused_forward_runs_image_rows_with_their_rotary_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused C forward takes the image rows' embeddings and M-RoPE rows (prefill and decode at i + delta);
    its tokens equal the layer-by-layer path's."""
    from nxdserve.engine.models import fused_decode

    if not fused_decode.available():
        pytest.skip("the fused C forward is not built on this machine")
    core = make_core(dtype="bfloat16")
    prompts = [prompt(1), prompt(0), prompt(2, first_image=1)]
    calls_with_images = 0
    real_run = fused_decode.FusedDecode.run

    def counting_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls_with_images
        # run(x, meta, kv_cache, keep, on_compute, cos_sin): the M-RoPE rows come as the sixth argument
        cos_sin = kwargs.get("cos_sin", args[5] if len(args) > 5 else None)
        calls_with_images += cos_sin is not None
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(fused_decode.FusedDecode, "run", counting_run)
    fused = [tokens(o) for o in run(core, prompts)]
    assert calls_with_images >= NEW_TOKENS  # every step ran image rows through the C forward
    monkeypatch.setattr(fused_decode, "enabled", False)
    assert [tokens(o) for o in run(core, prompts)] == fused


def test_a_recurring_image_is_encoded_once_per_admitting_step() -> None:
    core = make_core()
    image = random_image(112, 84, seed=3)
    twice = processor().process(list(tokenizer().encode(TEXTS[2])), [image, image])
    once = processor().process(list(tokenizer().encode(TEXTS[1])), [image])
    model: Any = core.backend
    before = model.vlm.num_images_encoded
    outs = run(core, [twice, once])  # admitted in the same step
    assert model.vlm.num_images_encoded - before == 1
    assert [tokens(o) for o in outs] == [reference_tokens(*twice), reference_tokens(*once)]
