"""Multi-LoRA serving: PEFT adapters (``adapter``), the engine's registry of them (``registry``), the forward's
stacked buffers and grouped shrink/expand (``stack``). See docs/lora.md."""

from nxdserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
