"""A tiny random Qwen2-VL checkpoint an engine can serve: weights from a transformers config (no download), the
default model's tokenizer with Qwen2-VL's vision tokens added, a chat template that places them, and the
model's image processor (``Qwen2VLImageProcessor``, sized small so images take few tokens). The full
``Qwen2VLProcessor`` also needs a video processor, which needs torchvision (not installed here). And a tiny random
Mllama (Llama 3.2 Vision, ``build_tiny_mllama``) with its ``MllamaImageProcessor`` and a template placing
``<|image|>``."""

from __future__ import annotations

import base64
import io
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nxdserve.engine.core import EngineCore
from nxdserve.engine.mm_inputs import MultiModalInputs
from nxdserve.engine.outputs import RequestOutput
from nxdserve.sampling_params import OutputKind, SamplingParams
from tests.helpers.tiny_model import copy_default_tokenizer

NEW_TOKENS = 8  # what the engine tests of both families generate per request
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
MAX_PIXELS = 112 * 112  # an image takes at most 16 tokens (8x8 patches merged 2x2)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string -%}{{ message.content }}"
    "{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


def build_tiny_qwen2_vl(
    out_dir: Path,
    seed: int = 0,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    max_pixels: int = MAX_PIXELS,
) -> Path:
    """``text``/``vision``: overrides of the tiny text and vision configs (benchmarks use larger ones)."""
    from transformers import (
        AutoTokenizer,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    copy_default_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    start, image, end = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text_config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": len(tokenizer), "max_position_embeddings": 512,
                   "bos_token_id": None, "eos_token_id": None,
                   "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, **(text or {})}  # fmt: skip
    vision_config = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, **(vision or {})}
    vision_config["hidden_size"] = text_config["hidden_size"]  # the merger projects into the decoder's width
    config = Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=image, vision_start_token_id=start, vision_end_token_id=end,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # transformers' tiny init gives near-constant logits: scale up, perturb norms and biases
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.15 * noise)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    image_processor = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=max_pixels)
    image_processor.save_pretrained(str(out_dir))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


@cache
def tiny_qwen2_vl_path() -> Path:
    """One checkpoint per test session, in a temp folder removed at interpreter exit."""
    import atexit

    root = Path(tempfile.mkdtemp(prefix="nxdserve-tiny-vlm-"))
    atexit.register(shutil.rmtree, root, True)
    return build_tiny_qwen2_vl(root / "qwen2-vl")


def random_image(width: int, height: int, seed: int) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def data_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# -- Mllama (Llama 3.2 Vision) --------------------------------------------------------------------------------

MLLAMA_IMAGE_TOKEN = "<|image|>"
MLLAMA_TILE = 28  # each tile is 2x2 patches of 14 pixels (+ the class token: 5 vision tokens a tile)

MLLAMA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string -%}{{ message.content }}"
    "{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}<|image|>"
    "{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


def build_tiny_mllama(
    out_dir: Path,
    seed: int = 0,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    tile: int = MLLAMA_TILE,
    max_tiles: int = 2,
) -> Path:
    """A random Mllama: 4 decoder layers, cross-attention at 1 and 3; a 2-layer local + 1 global vision encoder
    over tiles of ``tile`` pixels, at most ``max_tiles`` (2 or 4) an image (``MllamaImageProcessor``, saved
    beside it)."""
    from transformers import AutoTokenizer, MllamaConfig, MllamaForConditionalGeneration, MllamaImageProcessor

    out_dir.mkdir(parents=True, exist_ok=True)
    copy_default_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": [MLLAMA_IMAGE_TOKEN]})
    image = tokenizer.convert_tokens_to_ids(MLLAMA_IMAGE_TOKEN)
    text_config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": len(tokenizer), "max_position_embeddings": 512,
                   "cross_attention_layers": [1, 3], "bos_token_id": tokenizer.bos_token_id,
                   "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.eos_token_id,
                   **(text or {})}  # fmt: skip
    vision_config = {"hidden_size": 32, "num_hidden_layers": 2, "num_global_layers": 1, "attention_heads": 2,
                     "intermediate_size": 64, "image_size": tile, "patch_size": 14, "max_num_tiles": max_tiles,
                     "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]] if max_tiles == 2 else None,
                     "intermediate_layers_indices": [0],
                     **(vision or {})}  # fmt: skip
    # The tower's output: its last hidden state and each intermediate layer's, concatenated.
    layers_out = 1 + len(vision_config["intermediate_layers_indices"])
    vision_config["vision_output_dim"] = vision_config["hidden_size"] * layers_out
    config = MllamaConfig(text_config=text_config, vision_config=vision_config, image_token_index=image)
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # as the Qwen2-VL builder: visible logits; gates open (transformers inits them at 0)
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif "gate" in name and param.numel() == 1:
                param.copy_(0.5 + 0.3 * noise)
            else:
                param.copy_(0.15 * noise)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    image_processor = MllamaImageProcessor(size={"height": tile, "width": tile}, max_image_tiles=max_tiles)
    image_processor.save_pretrained(str(out_dir))
    tokenizer.chat_template = MLLAMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


@cache
def tiny_mllama_path() -> Path:
    import atexit

    root = Path(tempfile.mkdtemp(prefix="nxdserve-tiny-mllama-"))
    atexit.register(shutil.rmtree, root, True)
    return build_tiny_mllama(root / "mllama")


def run(
    core: EngineCore,
    prompts: list[tuple[list[int], MultiModalInputs | None]],
    requests: list[Any] | None = None,
    new_tokens: int = NEW_TOKENS,
) -> list[RequestOutput]:
    """Every prompt (token ids and its images) at once, greedy, ``new_tokens`` each, to the end; ``requests``
    collects the engine's Request objects."""
    ids = []
    for token_ids, mm in prompts:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        params.output_kind = OutputKind.FINAL_ONLY
        request = core.make_request(token_ids, params)
        request.mm_inputs = mm
        core.add_request(request)
        ids.append(request.request_id)
        if requests is not None:
            requests.append(request)
    finals: dict[str, RequestOutput] = {}
    for _ in range(1000):
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
        if not core.has_unfinished:
            break
    assert not core.has_unfinished
    return [finals[i] for i in ids]


def tokens(out: RequestOutput) -> list[int]:
    return list(out.outputs[0].token_ids)
