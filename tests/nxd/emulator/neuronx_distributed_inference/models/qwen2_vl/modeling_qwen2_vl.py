"""NeuronQwen2VLForCausalLM: registered as NxDI registers it (MODEL_TYPES["qwen2_vl"]["causal-lm"])."""

from __future__ import annotations

from typing import ClassVar

from neuronx_distributed_inference.models.config import InferenceConfig
from neuronx_distributed_inference.models.image_to_text_model_base import (
    ImageToTextInferenceConfig,
    NeuronBaseForImageToText,
)


class Qwen2VLInferenceConfig(ImageToTextInferenceConfig):
    pass


class NeuronQwen2VLTextModel:
    pass


class NeuronQwen2VLForCausalLM(NeuronBaseForImageToText):
    _model_cls: ClassVar[type] = NeuronQwen2VLTextModel

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return Qwen2VLInferenceConfig
