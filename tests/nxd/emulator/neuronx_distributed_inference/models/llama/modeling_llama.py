"""NeuronLlamaForCausalLM and LlamaInferenceConfig (the emulated application over the torch model)."""

from __future__ import annotations

from typing import ClassVar

from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM


class NeuronLlamaModel:
    """Stands for the traced decoder class (``_model_cls``); FusedSpecNeuronConfig names it."""


class LlamaInferenceConfig(InferenceConfig):
    def add_derived_config(self) -> None:
        self.num_cores_per_group = 1

    def get_required_attributes(self) -> list[str]:
        # NxDI also requires rope_theta; transformers 5 nests it in rope_parameters, so it is not
        # required here (the reference model reads RoPE settings from the HF config itself).
        return [
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "num_key_value_heads",
            "pad_token_id",
            "vocab_size",
            "max_position_embeddings",
            "rms_norm_eps",
            "hidden_act",
        ]

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return NeuronConfig


class NeuronLlamaForCausalLM(NeuronBaseForCausalLM):
    _model_cls: ClassVar[type] = NeuronLlamaModel

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return LlamaInferenceConfig
