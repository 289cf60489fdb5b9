"""load_pretrained_config: the InferenceConfig hook that copies an HF config in (NxDI's semantics)."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from neuronx_distributed_inference.models.config import InferenceConfig, to_torch_dtype


def load_pretrained_config(
    model_path_or_name: str | os.PathLike[str] | None = None,
    hf_config: PretrainedConfig | None = None,
) -> Callable[[InferenceConfig], None]:
    def load_config(self: InferenceConfig) -> None:
        if (model_path_or_name is None) == (hf_config is None):
            raise ValueError('Please provide only one of "model_path_or_name" or "hf_config"')
        config: Any = AutoConfig.from_pretrained(model_path_or_name) if hf_config is None else hf_config
        config_dict = config.to_dict()
        hf_dtype = config_dict.get("dtype", config_dict.get("torch_dtype"))
        if hf_dtype is not None:
            if self.neuron_config is not None and not self.neuron_config.overrides_torch_dtype:
                self.neuron_config.torch_dtype = hf_dtype
                if isinstance(hf_dtype, str):
                    self.neuron_config.torch_dtype = to_torch_dtype(hf_dtype)
            config_dict.pop("dtype", None)
            config_dict.pop("torch_dtype", None)
        for k, v in config_dict.items():
            if isinstance(getattr(config, k, None), PretrainedConfig):
                config_dict[k] = SimpleNamespace(**v)
        self.__dict__.update(config_dict)
        if hasattr(config, "attribute_map"):
            self.attribute_map = config.attribute_map

    return load_config
