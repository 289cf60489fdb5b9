"""ImageToTextInferenceConfig and NeuronBaseForImageToText: the constructor contract of NxDI's
vision-language applications (models/image_to_text_model_base.py).

Their InferenceConfig takes a text and a vision NeuronConfig, not one, and nests the HF config's
``text_config`` / ``vision_config`` as InferenceConfigs of their own. The emulator keeps exactly that
contract, so a caller that builds these configs with a single NeuronConfig fails here as it does on
NxD (TypeError). Image forward inputs are not emulated: nxdserve refuses these applications at start-up.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM


class ImageToTextInferenceConfig(InferenceConfig):
    def __init__(
        self,
        text_neuron_config: NeuronConfig,
        vision_neuron_config: NeuronConfig,
        fused_spec_config: Any = None,
        load_config: Any = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            neuron_config=copy.deepcopy(text_neuron_config),
            fused_spec_config=fused_spec_config,
            load_config=load_config,
            metadata=metadata,
            **kwargs,
        )
        assert hasattr(self, "text_config"), "Passed config doesn't contain text_config"
        assert hasattr(self, "vision_config"), "Passed config doesn't contain vision_config"
        text = self.text_config
        vision = self.vision_config
        self.text_config = InferenceConfig(text_neuron_config, **(vars(text) if isinstance(text, SimpleNamespace)
                                                                  else dict(text)))
        self.vision_config = InferenceConfig(
            vision_neuron_config, **(vars(vision) if isinstance(vision, SimpleNamespace) else dict(vision))
        )

    def validate_config(self) -> None:  # the nested configs are checked by the families
        return None

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return NeuronConfig


class NeuronBaseForImageToText(NeuronBaseForCausalLM):
    pass
