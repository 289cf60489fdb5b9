"""PEFT LoRA adapters: read ``adapter_config.json`` + ``adapter_model.safetensors``, check them against the
base model, and keep their weights on the host, ready to be copied into the forward's buffers.

PEFT's forward is ``y = W x + s * B (A x)`` with ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``); ``s`` is folded into B here, so the batched forward applies no scale (as vLLM does).
Everything an adapter could get wrong (shapes, rank, targets, features we do not run) is a
``LoRAAdapterError`` at load, never a failure inside a forward.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nxdserve.engine.models.spec import ModelSpec
from nxdserve.errors import LoRAAdapterError

# PEFT module name -> (our fused linear, slice index inside it)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
VALID_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def target_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """PEFT module -> (in_features, out_features) of the base linear it adapts."""
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


@dataclass
class LoraAdapter:
    """One adapter's host-side weights: ``weights[(layer, module)] = (A (r, in), B * scale (out, r))``, fp32."""

    name: str
    int_id: int
    path: str
    rank: int
    scaling: float
    target_modules: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    base_model_name: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_peft_adapter(
    path: str | Path, spec: ModelSpec, max_rank: int, name: str, int_id: int, base_model_name: str | None = None
) -> LoraAdapter:
    """Read and validate a PEFT adapter folder; file I/O: call it off the event loop."""
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no adapter_config.json in {folder}", param="lora_path")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: unreadable adapter_config.json: {exc}", "lora_path") from exc
    _check_config(config, name)
    rank = int(config.get("r", config.get("lora_rank", 0)))
    if rank <= 0:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: rank must be positive, got {rank}", param="lora_path")
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}", param="lora_path")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(folder, name)
    weights = _pair_tensors(tensors, spec, rank, scaling, name)
    return LoraAdapter(
        name=name,
        int_id=int_id,
        path=str(folder),
        rank=rank,
        scaling=scaling,
        target_modules=frozenset(module for _, module in weights),
        weights=weights,
        base_model_name=base_model_name,
    )


def _check_config(config: dict, name: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not LORA", "lora_path")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "bias": config.get("bias", "none") != "none",
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    bad = [key for key, on in unsupported.items() if on]
    if bad:
        raise LoRAAdapterError(f"LoRA adapter {name!r} uses unsupported PEFT features: {bad}", param="lora_path")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r} targets unsupported modules {unknown}; supported: {sorted(TARGETS)}",
                param="lora_path",
            )


def _read_tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {folder}", "lora_path")
    try:
        return load_file(str(file))
    except (OSError, SafetensorError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: unreadable weights: {exc}", param="lora_path") from exc


def _pair_tensors(
    tensors: dict[str, torch.Tensor], spec: ModelSpec, rank: int, scaling: float, name: str
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    shapes = target_shapes(spec)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in TARGETS:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: unsupported tensor {key!r}", param="lora_path")
        layer = int(match.group(1))
        if layer >= spec.num_layers:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {key!r} is for layer {layer}, the base model has {spec.num_layers}",
                param="lora_path",
            )
        halves.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    if not halves:
        raise LoRAAdapterError(f"LoRA adapter {name!r} holds no LoRA weights", param="lora_path")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B", "lora_path")
        a, b = pair["A"].float(), pair["B"].float()
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"this base model needs A ({rank}, {fan_in}) and B ({fan_out}, {rank})",
                param="lora_path",
            )
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    return weights
