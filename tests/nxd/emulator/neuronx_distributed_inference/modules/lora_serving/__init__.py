from neuronx_distributed_inference.modules.lora_serving.config import LoraServingConfig

__all__ = ["LoraServingConfig"]
