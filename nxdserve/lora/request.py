"""``LoRARequest``: which adapter a request runs with, as vLLM's ``vllm.lora.request.LoRARequest``."""

from __future__ import annotations

from dataclasses import dataclass

from nxdserve.errors import LoRAAdapterError


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # > 0 and unique per adapter; 0 means "no adapter" in vLLM
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id <= 0:
            raise LoRAAdapterError(f"lora_int_id must be > 0, got {self.lora_int_id}", param="lora_int_id")
        if not self.lora_name:
            raise LoRAAdapterError("lora_name must not be empty", param="lora_name")
