"""NeuronQwen3ForCausalLM: the same emulated decoder (the reference model reads the family's flags)."""

from __future__ import annotations

from typing import ClassVar

from neuronx_distributed_inference.models.config import InferenceConfig
from neuronx_distributed_inference.models.llama.modeling_llama import LlamaInferenceConfig, NeuronLlamaForCausalLM


class Qwen3InferenceConfig(LlamaInferenceConfig):
    pass


class NeuronQwen3Model:
    pass


class NeuronQwen3ForCausalLM(NeuronLlamaForCausalLM):
    _model_cls: ClassVar[type] = NeuronQwen3Model

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return Qwen3InferenceConfig
