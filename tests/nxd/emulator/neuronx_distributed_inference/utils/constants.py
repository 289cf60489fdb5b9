"""MODEL_TYPES: HF model_type -> task -> application class (the emulated subset of NxDI's table)."""

from __future__ import annotations

from neuronx_distributed_inference.models.llama.modeling_llama import NeuronLlamaForCausalLM
from neuronx_distributed_inference.models.mistral.modeling_mistral import NeuronMistralForCausalLM
from neuronx_distributed_inference.models.mllama.modeling_mllama import NeuronMllamaForCausalLM
from neuronx_distributed_inference.models.qwen2.modeling_qwen2 import NeuronQwen2ForCausalLM
from neuronx_distributed_inference.models.qwen2_vl.modeling_qwen2_vl import NeuronQwen2VLForCausalLM
from neuronx_distributed_inference.models.qwen3.modeling_qwen3 import NeuronQwen3ForCausalLM

CONTEXT_ENCODING_MODEL = "context_encoding_model"
TOKEN_GENERATION_MODEL = "token_generation_model"
FUSED_SPECULATION_MODEL = "fused_speculation_model"

MODEL_TYPES = {
    "llama": {"causal-lm": NeuronLlamaForCausalLM},
    "mistral": {"causal-lm": NeuronMistralForCausalLM},
    "mllama": {"causal-lm": NeuronMllamaForCausalLM},
    "qwen2": {"causal-lm": NeuronQwen2ForCausalLM},
    "qwen3": {"causal-lm": NeuronQwen3ForCausalLM},
    "qwen2_vl": {"causal-lm": NeuronQwen2VLForCausalLM},
}
