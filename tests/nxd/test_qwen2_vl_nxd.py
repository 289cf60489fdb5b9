"""Qwen2-VL image requests through ``--backend nxd`` on the emulator of NxD's image-to-text application.

NxD Inference's Qwen2-VL text model rotates every token at its 1-D ``position_ids`` in all three M-RoPE sections
(docs/neuron.md), so its image prompts are checked against transformers' Qwen2-VL run with those positions
(``position_ids`` = 0..L-1), and its text prompts against the torch backend (there the two rules agree).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.core import EngineCore
from nxdserve.engine.loader import build_engine_core
from nxdserve.engine.mm_inputs import MultiModalInputs
from nxdserve.errors import ConfigError, InvalidRequestError
from tests.engine.test_qwen2_vl_engine import NEW_TOKENS, PAD, processor, reference_model, run, tokenizer, tokens
from tests.helpers.tiny_model import single_torch_thread
from tests.helpers.tiny_vlm import random_image, tiny_qwen2_vl_path

IMAGE = 112  # the image size the emulated encoder is compiled for (8x8 patches, 16 image tokens)
VISION = {"vision_neuron_config": {"default_image_width": IMAGE, "default_image_height": IMAGE}}
TEXTS = {0: "Say something.", 1: f"Look: {PAD} and describe it.", 2: f"First {PAD} then {PAD} compare."}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


def make_core(backend: str = "nxd", **overrides: Any) -> EngineCore:
    settings: dict[str, Any] = {"model": str(tiny_qwen2_vl_path()), "backend": backend, "dtype": "float32",
                                "max_model_len": 128, "max_num_seqs": 4, "enable_chunked_prefill": False}
    if backend == "nxd":
        settings["override_neuron_config"] = VISION
    settings.update(overrides)
    return build_engine_core(EngineConfig(**settings), with_metrics=False)[0]


@pytest.fixture(scope="module")
def nxd_core() -> EngineCore:
    return make_core()


def prompt(num_images: int, seed: int = 0, size: int = IMAGE) -> tuple[list[int], MultiModalInputs | None]:
    ids = list(tokenizer().encode(TEXTS[num_images]))
    if not num_images:
        return ids, None
    return processor().process(ids, [random_image(size, size, seed=seed + i) for i in range(num_images)])


def nxd_rule_reference(ids: list[int], mm: MultiModalInputs | None) -> list[int]:
    """transformers' Qwen2-VL, greedy, every token at its 1-D position in all three rotary sections."""
    out = list(ids)
    extra = {} if mm is None else {"pixel_values": mm.pixel_values, "image_grid_thw": mm.image_grid_thw}
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            input_ids = torch.tensor([out])
            logits = reference_model()(input_ids=input_ids, position_ids=torch.arange(len(out))[None], **extra).logits
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids):]


@cache
def torch_core() -> EngineCore:
    return make_core("torch")


@pytest.mark.parametrize("num_images", [1, 2])
def test_image_prompts_give_nxds_greedy_text(nxd_core: EngineCore, num_images: int) -> None:
    ids, mm = prompt(num_images)
    app = nxd_core.backend.app  # type: ignore[attr-defined]
    calls = len(app.vision_calls)
    assert tokens(run(nxd_core, [(ids, mm)])[0]) == nxd_rule_reference(ids, mm)
    assert app.vision_calls[calls:] == [{"images": num_images, "bucket": num_images}]  # one encoder call


def test_text_prompts_equal_the_torch_backend(nxd_core: EngineCore) -> None:
    ids, _ = prompt(0)
    assert tokens(run(nxd_core, [(ids, None)])[0]) == tokens(run(torch_core(), [(ids, None)])[0])


def test_mixed_batch_gives_each_request_its_output_alone(nxd_core: EngineCore) -> None:
    prompts = [prompt(1, seed=5), prompt(0), prompt(2, seed=7), prompt(1, seed=9)]
    alone = [tokens(run(nxd_core, [p])[0]) for p in prompts]
    together = [tokens(out) for out in run(nxd_core, prompts)]
    assert together == alone
    assert alone[0] != alone[3]  # the image reaches the model: another image, other text


def test_capabilities_and_image_admission(nxd_core: EngineCore) -> None:
    backend: Any = nxd_core.backend
    assert nxd_core.capabilities.image_inputs and backend.image_grid == (1, 8, 8)
    backend.validate_images(prompt(2)[1])
    with pytest.raises(InvalidRequestError, match="compiled for 8x8") as err:
        backend.validate_images(prompt(1, size=56)[1])
    assert err.value.param == "multi_modal_data.image"
    images = [random_image(IMAGE, IMAGE, seed=i) for i in range(9)]  # 16 tokens each: 8 fill the 128 positions
    too_many = processor().process(list(tokenizer().encode(PAD * 9)), images)
    with pytest.raises(InvalidRequestError, match="at most 8"):
        backend.validate_images(too_many[1])


def test_configs_built_as_nxd_builds_them(nxd_core: EngineCore) -> None:
    app: Any = nxd_core.backend.app  # type: ignore[attr-defined]
    text_nc, vision_nc = app.text_config.neuron_config, app.vision_config.neuron_config
    assert type(app.full_config).__name__ == "Qwen2VLInferenceConfig"
    assert (text_nc.batch_size, text_nc.seq_len, text_nc.on_device_sampling_config.dynamic) == (4, 128, True)
    assert vision_nc.fused_qkv and vision_nc.buckets == [1, 2, 4, 8] and vision_nc.batch_size == 1
    assert (vision_nc.default_image_width, vision_nc.default_image_height) == (IMAGE, IMAGE)


@pytest.mark.parametrize("flag", [{"enable_lora": True}, {"quantization": "int8"}])
def test_what_nxds_qwen2_vl_does_not_run_is_refused(flag: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="not supported with Qwen2-VL on the nxd backend"):
        make_core(**flag)


def test_compiles_text_and_vision_models_once_and_loads_a_named_folder(
    nxd_core: EngineCore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from neuronx_distributed_inference.models import application_base

    compiled = len(application_base.COMPILE_LOG)
    again = make_core()  # the module's core compiled this configuration already
    assert len(application_base.COMPILE_LOG) == compiled and not again.backend.loaded.compiled_now  # type: ignore[attr-defined]
    folder = tmp_path / "compiled"
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(folder))
    first = make_core()
    assert (folder / "text_model" / "model.pt").is_file() and (folder / "vision_model" / "model.pt").is_file()
    second = make_core()  # from the folder: its saved config rebuilt with both NeuronConfigs
    assert len(application_base.COMPILE_LOG) == compiled + 1
    ids, mm = prompt(1, seed=3)
    assert tokens(run(second, [(ids, mm)])[0]) == tokens(run(first, [(ids, mm)])[0])


@pytest.mark.anyio
async def test_chat_completions_with_a_data_url_image_through_the_server() -> None:
    """The server on ``--backend nxd``: the chat template, the processor, NxD's image inputs; an image of another
    size than the compiled one is a 400 naming the images, and the engine keeps serving."""
    import httpx

    from tests.api.conftest import API_KEY, MODEL_NAME, start_server
    from tests.helpers.tiny_vlm import data_url

    server = start_server(api_key=API_KEY, model=str(tiny_qwen2_vl_path()), backend="nxd", max_model_len=128,
                          max_num_seqs=4, enable_chunked_prefill=False, override_neuron_config=VISION)
    image = random_image(IMAGE, IMAGE, seed=21)
    content = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]

    def body(parts: list[dict[str, Any]]) -> dict[str, Any]:
        return {"model": MODEL_NAME, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": parts}]}  # fmt: skip

    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120) as http:
            response = await http.post("/v1/chat/completions", json=body(content))
            assert response.status_code == 200, response.text
            text = tokenizer().apply_chat_template(
                [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"}]}],
                add_generation_prompt=True, tokenize=False,
            )  # fmt: skip
            ids, mm = processor().process(list(tokenizer().encode(text)), [image])
            want = tokenizer().decode(nxd_rule_reference(ids, mm), skip_special_tokens=True)
            assert response.json()["choices"][0]["message"]["content"] == want
            assert response.json()["usage"]["prompt_tokens"] == len(ids)
            small = [{"type": "image_url", "image_url": {"url": data_url(random_image(56, 56, seed=2))}}]
            response = await http.post("/v1/chat/completions", json=body(small))
            assert response.status_code == 400, response.text
            assert "multi_modal_data.image" in response.json()["error"]["param"]
            assert "compiled for 8x8" in response.json()["error"]["message"]
            response = await http.post("/v1/chat/completions", json=body(content))
            assert response.json()["choices"][0]["message"]["content"] == want
    finally:
        server.stop()


def test_a_preempted_image_request_resumes_with_its_images() -> None:
    """Priority preemption resumes by recompute: the victim's context encoding carries its images again."""
    from nxdserve.sampling_params import OutputKind, SamplingParams

    core = make_core(max_num_seqs=2, scheduling_policy="priority")
    jobs = [(*prompt(1, seed=31), 5), (*prompt(2, seed=33), 5), (*prompt(0), 0)]

    def submit(ids: list[int], mm: MultiModalInputs | None, priority: int) -> str:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                output_kind=OutputKind.FINAL_ONLY)  # fmt: skip
        request = core.make_request(ids, params, priority=priority)
        request.mm_inputs = mm
        core.add_request(request)
        return request.request_id

    def drive(late_after: int) -> list[list[int]]:
        """The two image jobs, then the urgent text job after ``late_after`` steps; outputs in job order."""
        ids = [submit(*job) for job in jobs[:2]]
        finals: dict[str, list[int]] = {}
        for step in range(500):
            if step == late_after:
                ids.append(submit(*jobs[2]))
            finals.update({o.request_id: list(o.outputs[0].token_ids) for o in core.step() if o.finished})
            if not core.has_unfinished and step >= late_after:
                break
        return [finals[i] for i in ids]

    alone = [tokens(run(core, [(ids, mm)])[0]) for ids, mm, _ in jobs]
    app: Any = core.backend.app  # type: ignore[attr-defined]
    encoded = len(app.vision_calls)
    assert drive(late_after=3) == alone
    assert core.scheduler.num_preemptions_total == 1
    assert len(app.vision_calls) - encoded == 3  # both image prompts, and the victim's once more
