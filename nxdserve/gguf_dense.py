"""A llama-architecture .gguf file's tensors dequantized into an HF folder's safetensors one layer at a time.

transformers' GGUF loader dequantizes the whole file into memory before it saves anything: a model's dense fp32
weights at once (~32 GB for an 8B model), once per file, on first use. Here each tensor is dequantized with the
same ``gguf.quants.dequantize`` transformers uses, the q / k rows put back in transformers' order
(``gguf_weights._reverse_permute``), and written in fp32 (the dequantized Q4 / Q8 values are not exact in bf16) to
a safetensors shard per decoder layer with the usual ``model.safetensors.index.json``; memory holds one layer.
The result is tensor for tensor what transformers writes (tested). Files of other architectures, or with
tensors outside the llama set (biases, rope tables, ...), return False and keep transformers' path.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF name (without .weight) -> the HF name; blk.N.x -> model.layers.N.<_BLOCK[x]>.weight
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
INDEX = "model.safetensors.index.json"


def hf_name(gguf_name: str) -> str | None:
    """The HF tensor name of a llama GGUF tensor, or None for one outside the set this writer maps."""
    base = gguf_name.removesuffix(".weight")
    if base in _TOP:
        return f"{_TOP[base]}.weight"
    pieces = base.split(".")
    if len(pieces) == 3 and pieces[0] == "blk" and pieces[1].isdigit() and pieces[2] in _BLOCK:
        return f"model.layers.{pieces[1]}.{_BLOCK[pieces[2]]}.weight"
    return None


def write_weights(reader: Any, config: Any, out_dir: Path) -> bool:
    """Write ``reader``'s (a ``gguf.GGUFReader``) tensors as fp32 safetensors shards into ``out_dir``, one per
    decoder layer; False (nothing written) where the file is not one this writer maps."""
    if config.model_type != "llama" or not reader.tensors:
        return False
    names = [hf_name(t.name) for t in reader.tensors]
    if None in names or ("lm_head.weight" in names and config.tie_word_embeddings):
        return False
    groups = _groups(names)
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    for number, tensors in enumerate(_dequantized_groups(reader, config, groups), start=1):
        file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return True


def _groups(names: list[str | None]) -> list[list[int]]:
    """Tensor positions grouped into shards: each decoder layer's together, every other tensor alone."""
    by_layer: dict[str, list[int]] = {}
    groups: list[list[int]] = []
    for i, name in enumerate(names):
        assert name is not None
        if name.startswith("model.layers."):
            layer = name.split(".")[2]
            if layer not in by_layer:
                by_layer[layer] = []
                groups.append(by_layer[layer])
            by_layer[layer].append(i)
        else:
            groups.append([i])
    return groups


def _dequantized_groups(reader: Any, config: Any, groups: list[list[int]]) -> Iterator[dict[str, torch.Tensor]]:
    """Per group, its tensors by HF name, dequantized to fp32 (q / k rows in transformers' order)."""
    from gguf.quants import dequantize

    from nxdserve.engine.models.gguf_weights import _reverse_permute

    for group in groups:
        tensors: dict[str, torch.Tensor] = {}
        for i in group:
            tensor = reader.tensors[i]
            name = hf_name(tensor.name)
            assert name is not None
            values = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                values = _reverse_permute(values, heads)
            tensors[name] = values.contiguous()
        yield tensors
