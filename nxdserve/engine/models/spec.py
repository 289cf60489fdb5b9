"""ModelSpec: the handful of facts our Llama-family module needs, read once from an HF config.

Llama, Mistral, Qwen2, Qwen3 and SmolLM (model_type "llama") differ only in a few flags: biases on the
attention projections, per-head q/k RMSNorm (Qwen3), sliding-window layers (Mistral, Qwen2/3 when
enabled), RoPE scaling and tied embeddings. Everything else is the same decoder block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nxdserve.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE types whose inverse frequencies do not depend on the running sequence length within
# max_position_embeddings (dynamic NTK equals default there; see rope.py).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    # Per layer: attend only to keys with q_pos - k_pos < window; None for full attention.
    sliding_windows: tuple[int | None, ...]
    rope_type: str

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"Model type {model_type!r} is not supported by the torch backend "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})."
            )
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads.")
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
        hidden_act = str(getattr(config, "hidden_act", "silu"))
        if hidden_act not in _ACTIVATIONS:
            raise ConfigError(f"Activation {hidden_act!r} is not supported by the torch backend.")

        attention_bias = bool(getattr(config, "attention_bias", False))
        if model_type == "qwen2":  # Qwen2 always has q/k/v biases and never an o_proj bias
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = attention_bias

        rope_type = _rope_type(config)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"RoPE type {rope_type!r} is not supported by the torch backend.")

        return cls(
            model_type=model_type,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=int(config.max_position_embeddings),
            hidden_act=hidden_act,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_windows=_sliding_windows(config, model_type),
            rope_type=rope_type,
        )


def _rope_type(config: Any) -> str:
    # transformers >= 5 normalises the legacy ``rope_scaling`` into ``rope_parameters``.
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def _sliding_windows(config: Any, model_type: str) -> tuple[int | None, ...]:
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if model_type == "llama" or not window:
        return (None,) * n
    if model_type == "mistral":  # every layer slides when the config sets a window
        return (int(window),) * n
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * n
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
