"""The torch backend's own Llama-family modelling: model, slot KV cache, attention and runner."""

from nxdserve.engine.models.attention import AttentionMetadata, SlotKVCache
from nxdserve.engine.models.device import resolve_device, resolve_dtype
from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.engine.models.runner import SlotModelRunner
from nxdserve.engine.models.spec import ModelSpec

__all__ = [
    "AttentionMetadata",
    "LlamaFamilyModel",
    "ModelSpec",
    "SlotKVCache",
    "SlotModelRunner",
    "resolve_device",
    "resolve_dtype",
]
