"""Emulated weight quantization: what NxD does with ``quantized=True``.

``quantize_state_dict`` stands for ``generate_quantized_state_dict`` (neuronx_distributed's
``quantize_pytorch_model_per_{tensor,channel}_symmetric`` over the HF model, then ``prepare_quantized_state_dict``):
every decoder linear's weight becomes int8 or float8_e4m3fn codes with an fp32 ``.scale`` (absmax over the
output channel, or the whole tensor, over the dtype's largest value), modules named in ``modules_to_not_convert``
(per channel) stay dense; names are the HF model's inner ``model.state_dict()`` ones, so ``lm_head`` is not in
it. ``apply_quantized_checkpoint`` is the load side: the codes and scales from ``quantized_checkpoints_path``
replace the reference model's linears (``nxdserve.engine.models.quant.QuantLinear``, the runtime the torch
backend uses for the same formats), so the model computes with the quantized weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from nxdserve.engine.models.quant import QuantLinear

_PROJECTIONS = {  # HF projection -> (our fused weight, position)
    "self_attn.q_proj": ("qkv_weight", 0), "self_attn.k_proj": ("qkv_weight", 1),
    "self_attn.v_proj": ("qkv_weight", 2), "self_attn.o_proj": ("o_weight", 0),
    "mlp.gate_proj": ("gate_up_weight", 0), "mlp.up_proj": ("gate_up_weight", 1), "mlp.down_proj": ("down_weight", 0),
}  # fmt: skip
_DTYPES = {"int8": (torch.int8, 127.0), "f8e4m3": (torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max))}


def _read_hf(model_path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _skipped(module: str, modules_to_not_convert: list[str] | None) -> bool:
    return any(module == name or module.endswith("." + name) for name in modules_to_not_convert or [])


def quantize_state_dict(model_path: str, nc: Any) -> dict[str, torch.Tensor]:
    dtype, largest = _DTYPES[nc.quantization_dtype]
    per_channel = nc.quantization_type == "per_channel_symmetric"
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _read_hf(model_path).items():
        if not name.startswith("model."):  # lm_head is outside the inner model's state dict
            continue
        inner = name.removeprefix("model.")
        module = inner.removesuffix(".weight")
        is_linear = inner.endswith(".weight") and any(module.endswith(p) for p in _PROJECTIONS)
        if not is_linear or (per_channel and _skipped(module, nc.modules_to_not_convert)):
            out[inner] = tensor
            continue
        weight = tensor.float()
        absmax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax().reshape(1, 1)
        scale = (absmax / largest).clamp_min(1e-12)
        scaled = weight / scale
        codes = torch.round(scaled).clamp(-largest, largest) if dtype == torch.int8 else scaled.clamp(-largest, largest)
        out[inner] = codes.to(dtype)
        out[f"{module}.scale"] = scale
    return out


def save_state_dict(state_dict: dict[str, torch.Tensor], path: str) -> None:
    """NxD's save: safetensors into an existing folder, else one torch.save file."""
    if os.path.isdir(path):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state_dict.items()}, os.path.join(path, "model.safetensors"))
    else:
        torch.save(state_dict, path)


def load_quantized_checkpoint(path: str) -> dict[str, torch.Tensor]:
    if os.path.isdir(path):
        return _read_hf(path)
    if not os.path.isfile(path):  # NxD's checkpoint loader fails on a missing quantized checkpoint
        raise FileNotFoundError(f"quantized checkpoint {path} does not exist; run save_quantized_state_dict first")
    loaded: dict[str, torch.Tensor] = torch.load(path, map_location="cpu", weights_only=True)
    return loaded


def apply_quantized_checkpoint(model: Any, nc: Any) -> None:
    state = load_quantized_checkpoint(nc.quantized_checkpoints_path)
    parts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or f"{module}.scale" not in state:
            continue
        pieces = module.split(".")
        attr, position = _PROJECTIONS[".".join(pieces[2:])]
        scale = state[f"{module}.scale"].float().reshape(-1).expand(tensor.shape[0])
        parts.setdefault(f"{pieces[0]}.{pieces[1]}.{attr}", {})[position] = (tensor, scale)
    table: dict[str, QuantLinear] = {}
    for key, by_position in parts.items():
        ordered = [by_position[i] for i in sorted(by_position)]
        codes = torch.cat([p[0] for p in ordered]).contiguous()
        kind = "int8" if codes.dtype == torch.int8 else "fp8"
        table[key] = QuantLinear(kind, codes.shape[0], codes.shape[1], codes, torch.cat([p[1] for p in ordered]))
    model.quantize_linears(lambda name, _weight: table.get(name))
