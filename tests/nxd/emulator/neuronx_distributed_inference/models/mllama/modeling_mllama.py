"""NeuronMllamaForCausalLM: registered as NxDI registers it (MODEL_TYPES["mllama"]["causal-lm"]). NxDI builds
Mllama from one NeuronConfig (MllamaInferenceConfig is a plain InferenceConfig, the application a
NeuronBaseForCausalLM with cross-attention); only the class and config shape are emulated: nxdserve refuses the
checkpoint at start-up from its ``vision_config``."""

from __future__ import annotations

from typing import Any

from neuronx_distributed_inference.models.config import InferenceConfig
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM


class MllamaInferenceConfig(InferenceConfig):
    pass


class NeuronMllamaForCausalLM(NeuronBaseForCausalLM):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("emulator: Mllama's application is not emulated")

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return MllamaInferenceConfig
