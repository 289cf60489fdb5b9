"""How many KV slots fit: vLLM sizes its KV cache from ``--gpu-memory-utilization`` (CUDA),
``VLLM_CPU_KVCACHE_SPACE`` (CPU, GiB) or ``--kv-cache-memory-bytes``; here the cache is one slot of
max_model_len tokens per sequence, so the space given becomes a slot count, and max_num_seqs is lowered to
it when fewer fit (max_num_seqs stays the cap when more do). Nothing given: max_num_seqs x max_model_len."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nxdserve.config import KV_CACHE_DTYPES, EngineConfig
from nxdserve.errors import ConfigError

logger = logging.getLogger(__name__)

CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
_GIB = 2**30


@dataclass(frozen=True)
class KVBudget:
    bytes: int
    source: str  # what set it, for the log line and errors


def kv_element_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes one cached K or V element takes: 1 for an fp8 ``--kv-cache-dtype``, else the model dtype's."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}.")
    return model_dtype_bytes if kv_cache_dtype == "auto" else 1


def kv_bytes_per_slot(hf_config: Any, max_model_len: int, dtype_bytes: int) -> int:
    """Bytes of K and V for one sequence of max_model_len tokens, as the slot cache lays them out."""
    text = getattr(hf_config, "text_config", None) or hf_config
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return layers * 2 * kv_heads * max_model_len * head_dim * dtype_bytes


def kv_budget(config: EngineConfig, device_type: str, model_path: Path) -> KVBudget | None:
    """The KV space the flags ask for, or None when none was asked for."""
    if config.kv_cache_memory_bytes is not None:
        return KVBudget(config.kv_cache_memory_bytes, "--kv-cache-memory-bytes")
    if device_type == "cpu":
        space = os.environ.get(CPU_KV_SPACE_ENV)
        if space:
            try:
                gib = float(space)
            except ValueError as exc:
                raise ConfigError(f"{CPU_KV_SPACE_ENV}={space!r} is not a number of GiB.") from exc
            if gib > 0:  # vLLM: 0 means "decide automatically"
                return KVBudget(int(gib * _GIB), f"{CPU_KV_SPACE_ENV}={space} GiB")
        if config.gpu_memory_utilization is not None:
            logger.info(
                "--gpu-memory-utilization sizes the KV cache on CUDA only; on CPU set %s (GiB)", CPU_KV_SPACE_ENV
            )
        return None
    if config.gpu_memory_utilization is None:
        return None
    # its range is EngineConfig.resolve's check, run before any sizing
    import torch

    _, total = torch.cuda.mem_get_info()
    weights = sum(f.stat().st_size for f in model_path.glob("*.safetensors"))  # what loading will take, about
    free = int(total * config.gpu_memory_utilization) - weights
    return KVBudget(max(free, 0), f"--gpu-memory-utilization {config.gpu_memory_utilization} of "
                    f"{total / _GIB:.1f} GiB less {weights / _GIB:.2f} GiB of weights")  # fmt: skip


def fit_slots(config: EngineConfig, budget: KVBudget, per_slot: int, kv_cache_dtype: str = "auto") -> int:
    """Lower config.max_num_seqs to the slots ``budget`` holds; ConfigError when not even one fits."""
    assert config.max_model_len is not None
    fits = budget.bytes // per_slot
    if fits < 1:
        raise ConfigError(
            f"The KV space ({budget.source}: {budget.bytes / 2**20:.0f} MiB) holds no sequence of "
            f"max_model_len={config.max_model_len} ({per_slot / 2**20:.1f} MiB each): give more space or lower "
            "--max-model-len."
        )
    slots = min(fits, config.max_num_seqs)
    logger.info(
        "KV cache (%s): %s fits %d sequences of %d tokens (%.1f MiB each); serving %d at once%s",
        kv_cache_dtype, budget.source, fits, config.max_model_len, per_slot / 2**20, slots,
        f" (max_num_seqs lowered from {config.max_num_seqs})" if slots < config.max_num_seqs else " (max_num_seqs)",
    )  # fmt: skip
    config.max_num_seqs = slots
    return slots
