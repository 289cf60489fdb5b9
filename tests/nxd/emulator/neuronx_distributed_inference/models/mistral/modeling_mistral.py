"""NeuronMistralForCausalLM: the same emulated decoder (the reference model reads the family's flags)."""

from __future__ import annotations

from typing import ClassVar

from neuronx_distributed_inference.models.config import InferenceConfig
from neuronx_distributed_inference.models.llama.modeling_llama import LlamaInferenceConfig, NeuronLlamaForCausalLM


class MistralInferenceConfig(LlamaInferenceConfig):
    pass


class NeuronMistralModel:
    pass


class NeuronMistralForCausalLM(NeuronLlamaForCausalLM):
    _model_cls: ClassVar[type] = NeuronMistralModel

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return MistralInferenceConfig
