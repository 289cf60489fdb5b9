"""LoraServingConfig with NxDI 0.9's keyword names (src/neuronx_distributed_inference/modules/lora_serving/config.py,
checked at the Neuron 2.29 release, commit c63afe02; NxDI <= 0.2 named ``max_cpu_loras`` ``max_loras_on_cpu``,
renamed by 0.7 in Neuron 2.27). The emulator serves the
static case: every adapter named in ``lora_ckpt_paths`` at compile time, a zero adapter at index 0 when
``enable_base_model_only`` (so base rows pass adapter id 0), adapter k of the paths at index k (+1)."""

from __future__ import annotations

from typing import Any


class LoraServingConfig:
    def __init__(
        self,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int = 100,
        batch_size: int = 1,
        target_modules: list[str] | None = None,
        lora_bias: str = "none",
        lora_ckpt_paths: dict[str, str] | list[str] | None = None,
        lora_ckpt_paths_cpu: Any = None,
        lora_ckpt_json: str | None = None,
        lora_memory_transpose: bool = True,
        lora_shard_linear_layer: bool = True,
        is_context_encoding: bool = False,
        dynamic_multi_lora: bool = False,
        eviction_policy: str = "lru",
        lfu_decay_period: int = 128,
        base_model_quantized: bool = False,
        enable_base_model_only: bool = False,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(f"LoraServingConfig got unexpected keyword arguments {sorted(kwargs)}")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.batch_size = batch_size
        self.target_modules = target_modules
        self.lora_bias = lora_bias
        self.lora_ckpt_paths = lora_ckpt_paths
        self.lora_ckpt_paths_cpu = lora_ckpt_paths_cpu
        self.lora_ckpt_json = lora_ckpt_json
        self.lora_memory_transpose = lora_memory_transpose
        self.lora_shard_linear_layer = lora_shard_linear_layer
        self.is_context_encoding = is_context_encoding
        self.dynamic_multi_lora = dynamic_multi_lora
        self.eviction_policy = eviction_policy
        self.lfu_decay_period = lfu_decay_period
        self.base_model_quantized = base_model_quantized
        self.enable_base_model_only = enable_base_model_only

    def ckpt_paths(self) -> list[tuple[str, str]]:
        """(adapter id, path) in index order; "id:path" strings or a dict, as NxDI accepts."""
        paths = self.lora_ckpt_paths or []
        if isinstance(paths, dict):
            return [(str(k), str(v)) for k, v in paths.items()]
        return [tuple(p.split(":", 1)) for p in paths]  # type: ignore[misc]
