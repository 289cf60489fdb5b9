"""Compressed-tensors checkpoints built in the test, as llm-compressor writes them: a tiny random llama
(tests/helpers/tiny_model.py) gets a scheme applied with the library's ``apply_quantization_config``, its
weight scales / zero points from the library's ``calculate_qparams`` over each channel / group / tensor
(round-to-nearest: what llm-compressor's QuantizationModifier computes without calibration data for
weights), and is compressed and saved by the library's ``ModelCompressor``."""

from __future__ import annotations

import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch

from tests.helpers.tiny_model import copy_default_tokenizer, tiny_model_path

# name -> (preset, overrides on the preset's weight args); group 32: the tiny model's rows are 64 / 128 wide.
SCHEMES: dict[str, tuple[str, dict[str, Any]]] = {
    "w8a16": ("W8A16", {"strategy": "channel", "group_size": None}),  # pack-quantized, int8 per channel
    "w8a16-g32": ("W8A16", {"group_size": 32}),  # pack-quantized, int8 per group of 32
    "w4a16": ("W4A16", {"group_size": 32}),  # pack-quantized, symmetric 4-bit groups
    "w4a16-asym": ("W4A16_ASYM", {"group_size": 32}),  # pack-quantized with zero points
    "w4a16-channel": ("W4A16", {"strategy": "channel", "group_size": None}),
    "w4a16-g16": ("W4A16", {"group_size": 16}),  # no exact 4-bit layout here
    "w8a8": ("W8A8", {}),  # int-quantized, dynamic per-token int8 activations
    "fp8-dynamic": ("FP8_DYNAMIC", {}),  # float-quantized, per channel, dynamic activations
    "fp8": ("FP8", {}),  # float-quantized, per tensor, static activation scales
}


def _minmax(weight: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    strategy = str(args.strategy)
    if strategy == "channel":
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    if strategy == "group":
        groups = weight.view(weight.shape[0], -1, args.group_size)
        return groups.amin(-1), groups.amax(-1)
    return weight.amin().reshape(1), weight.amax().reshape(1)


def build_compressed(scheme_name: str, out_dir: Path, ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    preset, overrides = SCHEMES[scheme_name]
    scheme = preset_name_to_scheme(preset, ["Linear"]).model_copy(deep=True)
    scheme.weights = scheme.weights.model_copy(update=overrides)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path("llama")), dtype=torch.float32)
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=list(ignore), quantization_status=QuantizationStatus.INITIALIZED
    )
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            module_scheme = getattr(module, "quantization_scheme", None)
            if module_scheme is None:
                continue
            low, high = _minmax(module.weight.detach(), module_scheme.weights)
            scale, zero_point = calculate_qparams(low, high, module_scheme.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
            if hasattr(module, "input_scale"):  # static activation scales (not used by the server)
                module.input_scale.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(out_dir))
    compressor.update_config(str(out_dir))
    copy_default_tokenizer(out_dir)
    return out_dir


@cache
def compressed_model_path(scheme_name: str) -> Path:
    """One checkpoint per scheme per test session, in a temp folder removed at interpreter exit."""
    root = Path(tempfile.mkdtemp(prefix="nxdserve-ct-"))
    import atexit

    atexit.register(shutil.rmtree, root, True)
    return build_compressed(scheme_name, root / scheme_name)
