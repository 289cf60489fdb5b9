"""Tiny random Llama-family checkpoints (hidden 64, 2 layers, GQA), built with transformers and saved
as ordinary HF folders, plus the default model's tokenizer so an engine can serve them.

Weights are seeded and scaled up from transformers' tiny default init (std 0.02 gives near-constant
logits, which would make logit comparisons blind to attention bugs); norm weights and biases are
randomised too, so every parameter matters.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 49152  # the default model's tokenizer, copied next to the weights
MAX_POSITIONS = 512


def _common(**overrides: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "tie_word_embeddings": True,
    }
    settings.update(overrides)
    return settings


def _llama(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_common(**overrides))


def _mistral(**overrides: Any) -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_common(**overrides))


def _qwen2(**overrides: Any) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_common(**overrides))


def _qwen3(**overrides: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**_common(**overrides))


# name -> config factory. Together they cover: tied and untied heads, MHA-like and 4:1 GQA, every RoPE
# scaling the backend supports, qkv biases, q/k norms, head_dim != hidden / heads, sliding windows on
# all layers (Mistral) and on some layers (Qwen2), and MLP/attention biases (Llama flags).
TINY_FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": lambda: _llama(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama-llama3-untied": lambda: _llama(
        tie_word_embeddings=False,
        num_key_value_heads=1,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-linear-bias": lambda: _llama(
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    "mistral-window": lambda: _mistral(sliding_window=6, head_dim=16),
    # SmolLM2's attention shape (head size 64, three query heads per KV head): the C kernels' vectorised items.
    "llama-d64-g3": lambda: _llama(
        hidden_size=192,
        intermediate_size=256,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "qwen2": lambda: _qwen2(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3": lambda: _qwen3(
        head_dim=32,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),
}


def build_tiny_model(family: str, out_dir: Path, seed: int = 0, with_tokenizer: bool = True) -> Path:
    """Write a seeded random checkpoint of ``family`` (a TINY_FAMILIES key) to ``out_dir``; returns it."""
    from transformers import AutoModelForCausalLM

    config = TINY_FAMILIES[family]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.15 * noise)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if with_tokenizer:
        copy_default_tokenizer(out_dir)
    return out_dir


def copy_default_tokenizer(out_dir: Path) -> None:
    from nxdserve.model_files import resolve_model

    source = resolve_model(None, progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out_dir / name)


@cache
def tiny_model_path(family: str) -> Path:
    """One checkpoint per family per test session, in a temp folder removed at interpreter exit."""
    root = Path(tempfile.mkdtemp(prefix="nxdserve-tiny-"))
    import atexit

    atexit.register(shutil.rmtree, root, True)
    return build_tiny_model(family, root / family)


@cache
def reference_model(path: Path) -> torch.nn.Module:
    """transformers' own implementation of a checkpoint (fp32, eager attention), loaded once per path."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


@contextlib.contextmanager
def single_torch_thread() -> Iterator[None]:
    """Run torch on one intra-op thread for the block, then restore.

    On a shared 2-core machine, libgomp's spinning barriers make every multi-threaded op wait for a
    descheduled sibling thread (measured: a tiny-model schedule took 2.5 s on 2 threads vs 0.1 s on
    one, unless OMP_WAIT_POLICY=PASSIVE is set before torch loads). Tests of numerics lose nothing on
    one thread.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def slot_meta(model: Any, slots: list[int], starts: list[int], lens: list[int], max_len: int) -> Any:
    """The AttentionMetadata of one step of ``model`` (a LlamaFamilyModel on the CPU): row i continues slot
    ``slots[i]`` from position ``starts[i]`` with ``lens[i]`` tokens, in a cache of ``max_len`` positions."""
    import numpy as np

    from nxdserve.engine.models.attention import AttentionMetadata

    return AttentionMetadata.build(
        np.array(slots), np.array(starts), np.array(lens),
        num_query_groups=model.spec.num_heads // model.spec.num_kv_heads, windows=model.windows,
        max_len=max_len, device=torch.device("cpu"), dtype=model.dtype,
    )  # fmt: skip
