"""NeuronApplicationBase: constructor, compile, load and warm-up with NxDI's signatures.

``compile`` writes ``neuron_config.json`` and ``model.pt`` (here a small JSON stand-in for the
torch.jit archive) into the artifact folder; ``load`` fails as ``torch.jit.load`` does when
``model.pt`` is missing, reads weights from the HF checkpoint ("shard on load") and warms up.
``COMPILE_LOG`` / ``LOAD_LOG`` record every call so tests can check compile-once caching;
``save_quantized_state_dict`` writes the emulated quantized checkpoint (modules/quantization.py), logged in
``SAVE_QUANTIZED_LOG``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch

from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig

logger = logging.getLogger(__name__)

COMPILED_MODEL_FILE_NAME = "model.pt"
COMPILE_LOG: list[str] = []
LOAD_LOG: list[str] = []
SAVE_QUANTIZED_LOG: list[str] = []  # every save_quantized_state_dict call's target path


def normalize_path(path: str | os.PathLike[str]) -> str:
    return os.path.join(os.path.normpath(path), "")


def is_compiled(model_path: str) -> bool:
    return os.path.isfile(model_path + COMPILED_MODEL_FILE_NAME)


class NeuronApplicationBase(torch.nn.Module):
    def __init__(
        self,
        model_path: str,
        config: InferenceConfig | None = None,
        neuron_config: NeuronConfig | None = None,
    ) -> None:
        super().__init__()
        model_path = normalize_path(model_path)
        if config is None:
            config = self.get_config_cls().load(model_path)
        if neuron_config is not None:
            config.neuron_config = neuron_config
        self.validate_config(config)
        self.config = config
        self.neuron_config = config.neuron_config
        self.fused_spec_config = config.fused_spec_config
        self.on_device_sampling = self.neuron_config.on_device_sampling_config is not None
        self.model_path = model_path
        self.is_compiled = is_compiled(model_path)
        self.is_loaded_to_neuron = False

    @classmethod
    def validate_config(cls, config: InferenceConfig) -> None:
        assert config.neuron_config is not None

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        raise NotImplementedError("get_config_cls is not implemented")

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return NeuronConfig

    def compile(self, compiled_model_path: str, debug: bool = False, pre_shard_weights_hook: Any = None,
                dry_run: bool = False) -> None:
        compiled_model_path = normalize_path(compiled_model_path)
        self.config.save(compiled_model_path)
        if dry_run:
            return
        COMPILE_LOG.append(compiled_model_path)
        archive = {"emulated": True, "config": json.loads(self.config.to_json_string())}
        with open(compiled_model_path + COMPILED_MODEL_FILE_NAME, "w", encoding="utf-8") as f:
            json.dump(archive, f)
        self.is_compiled = True

    def load(self, compiled_model_path: str, start_rank_id: int | None = None, local_ranks_size: int | None = None,
             skip_warmup: bool = False) -> None:
        compiled_model_path = normalize_path(compiled_model_path)
        archive_path = compiled_model_path + COMPILED_MODEL_FILE_NAME
        if not os.path.isfile(archive_path):  # torch.jit.load's error for a missing file
            raise ValueError(f"The provided filename {archive_path} does not exist")
        with open(archive_path, encoding="utf-8") as f:
            archive = json.load(f)
        if archive["config"] != json.loads(self.config.to_json_string()):
            # A real NEFF traced for other shapes fails at the first call; fail at load instead.
            raise ValueError(f"{archive_path} was compiled for a different configuration")
        LOAD_LOG.append(compiled_model_path)
        self.load_weights(compiled_model_path)
        self.is_loaded_to_neuron = True
        if not self.neuron_config.skip_warmup and not skip_warmup:
            self.warmup()

    def load_weights(self, compiled_model_path: str) -> None:
        raise NotImplementedError

    @classmethod
    def save_quantized_state_dict(cls, model_path: str, config: InferenceConfig) -> None:
        """Quantize the HF checkpoint and save it to ``config.neuron_config.quantized_checkpoints_path``."""
        from neuronx_distributed_inference.modules.quantization import save_state_dict

        model_path = normalize_path(model_path)
        SAVE_QUANTIZED_LOG.append(config.neuron_config.quantized_checkpoints_path)
        save_state_dict(cls.generate_quantized_state_dict(model_path, config),
                        config.neuron_config.quantized_checkpoints_path)  # fmt: skip

    @classmethod
    def generate_quantized_state_dict(cls, model_path: str, config: InferenceConfig) -> dict[str, torch.Tensor]:
        from neuronx_distributed_inference.modules.quantization import quantize_state_dict

        return quantize_state_dict(model_path, config.neuron_config)

    def warmup(self) -> None:
        logger.info("Warming up the model.")
        start = time.time()
        self._run_warmup()
        logger.info(f"Warmup completed in {time.time() - start} seconds.")

    def _run_warmup(self) -> None:
        raise NotImplementedError
