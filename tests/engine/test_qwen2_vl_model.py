"""Qwen2-VL on the torch backend's modules: logits of prompts with images equal transformers' (fp32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nxdserve.engine.models.qwen2_vl import Qwen2VLModel, mrope_positions
from tests.helpers.tiny_model import single_torch_thread

IMAGE, START, END = 500, 501, 502


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A seeded random tiny Qwen2-VL (no download), saved as safetensors, and transformers' model of it."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2},
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them so they are tested
        for name, param in reference.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    folder = tmp_path_factory.mktemp("qwen2-vl")
    reference.save_pretrained(folder)
    return folder, reference


def images_inputs(sizes: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    processor = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=112 * 112)
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def prompt_with_images(grid_thw: torch.Tensor, merge: int = 2) -> list[int]:
    ids = [7, 8, 9]
    for t, h, w in grid_thw.tolist():
        ids += [START] + [IMAGE] * (t * h * w // merge**2) + [END, 11, 12]
    return [*ids, 13, 14]


def test_mrope_positions_follow_the_image_grids() -> None:
    ids = [1, 2, START, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, END, 3]
    positions, delta = mrope_positions(ids, [[1, 4, 6]], IMAGE, 2)  # one 2x3 token grid
    assert positions[:, :3].tolist() == [[0, 1, 2]] * 3
    assert positions[:, 3:9].tolist() == [[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]
    assert positions[:, 9:].tolist() == [[6, 7]] * 3
    assert delta == 8 - len(ids)  # the next token, at index 11, rotates at position 8
    with pytest.raises(ValueError, match="does not match"):
        mrope_positions(ids[:5], [[1, 4, 6]], IMAGE, 2)


@pytest.mark.parametrize("sizes", [[(56, 56)], [(56, 84), (84, 56)]], ids=["one-image", "two-images"])
def test_logits_match_transformers(checkpoint: tuple[Path, Any], sizes: list[tuple[int, int]]) -> None:
    folder, reference = checkpoint
    pixel_values, grid_thw = images_inputs(sizes)
    ids = prompt_with_images(grid_thw)
    with single_torch_thread():
        model = Qwen2VLModel.from_pretrained(folder, torch.float32, torch.device("cpu"))
        ours = model.prefill_logits(ids, pixel_values, grid_thw)
        with torch.no_grad():
            input_ids = torch.tensor([ids])
            theirs = reference(
                input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid_thw,
                mm_token_type_ids=(input_ids == IMAGE).int(),  # 1 marks image tokens, as the processor returns
            ).logits[0].float()
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    text_only = model.prefill_logits([7, 8, 9, 10], None, None)
    with torch.no_grad():
        torch.testing.assert_close(text_only, reference(input_ids=torch.tensor([[7, 8, 9, 10]])).logits[0], rtol=1e-4,
                                   atol=1e-4)
