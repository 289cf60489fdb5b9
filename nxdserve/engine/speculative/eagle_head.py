"""The EAGLE-1 draft head: module, checkpoint layout, load and save.

Architecture (Li et al. 2024, arXiv 2401.15077; the layout NxD Inference's EAGLE draft expects):

    x_t  = fc([embed(token_{t+1}), f_t])          fc: 2H -> H (with bias)
    h_t  = DecoderLayer(x_t)  at position t         one Llama decoder layer (input RMSNorm optional)
    logits = lm_head(h_t)                           the target's LM head, no final norm

``f_t`` is the target's final-norm hidden state at position t (what its LM head reads), and ``h_t``
is trained to predict ``f_{t+1}``, so ``lm_head(h_t)`` predicts token t+2. Drafting chains: ``h_t``
stands in for the next feature. The embedding and LM head are the target's own; the head has only
fc + one layer (about 4.2M parameters for SmolLM2-135M).

Checkpoint folder (both layouts load here):
- ``config.json``: a Llama config with the target's dimensions, ``num_hidden_layers: 1``,
  ``fc_bias: true``, ``tie_word_embeddings: false``, and our ``eagle_config`` block
  (``input_norm``, ``draft_vocab_size``, ``target``);
- ``model.safetensors``: ``fc.weight`` (H, 2H), ``fc.bias``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``
  (``layers.0.input_layernorm.weight`` only with ``input_norm``; NxD then needs
  ``enable_eagle_draft_input_norm=True``); the native layout adds
  ``draft_vocab_ids`` (the truncated draft vocabulary, full-vocabulary ids, most frequent first);
  the NxD layout instead adds the target's ``embed_tokens.weight`` and ``lm_head.weight``
  (NxD's draft must carry the LM head) and leaves the truncated vocabulary out (NxD's EAGLE-1 draft
  has no vocabulary mapping; the full head is used there).
A ``model.`` prefix on names is accepted on load (NxD strips it too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nxdserve.engine.models.attention import AttentionMetadata, SlotKVCache
from nxdserve.engine.models.fused_decode import FusedDecode
from nxdserve.engine.models.linear import linear
from nxdserve.engine.models.llama import DecoderLayer
from nxdserve.engine.models.rope import RotaryTables, rope_inv_freq
from nxdserve.engine.models.spec import ModelSpec
from nxdserve.errors import ConfigError

WEIGHTS_FILE = "model.safetensors"
EAGLE_CONFIG_KEY = "eagle_config"
# config.json keys copied from the target so the head's attention and RoPE match it exactly.
_TARGET_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings", "vocab_size", "hidden_act",
    "bos_token_id", "eos_token_id", "pad_token_id",
)


def head_config_from_target(target_config: dict[str, Any], *, input_norm: bool = False,
                            draft_vocab_size: int | None = None, target_name: str = "") -> dict[str, Any]:
    """The head's config.json: Llama-style, the target's dimensions, one layer."""
    config = {k: target_config[k] for k in _TARGET_KEYS if target_config.get(k) is not None}
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "rope_theta" not in config and "rope_theta" in params:
        config["rope_theta"] = params["rope_theta"]  # NxD's LlamaInferenceConfig requires rope_theta
    config.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        fc_bias=True,
    )
    config[EAGLE_CONFIG_KEY] = {
        "version": 1,
        "input_norm": input_norm,
        "draft_vocab_size": draft_vocab_size,
        "target": target_name,
        "target_hidden": "final_norm",
    }
    return config


class EagleHead(nn.Module):
    """fc + one decoder layer over a slot KV cache of its own; embedding and LM head come from the target."""

    def __init__(self, config: dict[str, Any], dtype: torch.dtype, device: torch.device, max_len: int) -> None:
        super().__init__()
        from transformers import LlamaConfig

        hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != EAGLE_CONFIG_KEY})
        spec = ModelSpec.from_hf_config(hf_config)
        if spec.num_layers != 1:
            raise ConfigError(f"An EAGLE-1 head has exactly one decoder layer, this config has {spec.num_layers}.")
        self.spec = spec
        self.config = config
        eagle = config.get(EAGLE_CONFIG_KEY) or {}
        self.input_norm = bool(eagle.get("input_norm", False))
        self.dtype = dtype
        self.device = device
        self.max_len = max_len
        size = spec.hidden_size
        self.fc_weight = nn.Parameter(torch.empty(size, 2 * size, dtype=dtype, device=device), requires_grad=False)
        fc_bias = bool(config.get("fc_bias", True))
        self.fc_bias = (
            nn.Parameter(torch.zeros(size, dtype=dtype, device=device), requires_grad=False) if fc_bias else None
        )
        self.layer = DecoderLayer(spec, None, dtype, device)
        if not self.input_norm:
            # EAGLE-1 (and NxD's draft without enable_eagle_draft_input_norm) feeds fc's output straight in.
            self.layer.input_norm = nn.Identity()  # type: ignore[assignment]
        inv_freq, scaling = rope_inv_freq(hf_config, spec.head_dim, spec.rope_type)
        self.rope = RotaryTables(inv_freq, scaling, max_len, dtype, device)
        self.windows: frozenset[int | None] = frozenset({None})
        # bf16 on CPU: the layer runs through the fused C forward (one OpenMP region, no final norm). It
        # matters most for the cache update over every decoding row (chat, batch 8: 0.86x -> 0.92-0.96x plain).
        self.fused = FusedDecode(spec, [self.layer], self.rope)
        self.draft_vocab_ids: torch.Tensor | None = None  # (V',) int64 full-vocabulary ids

    @property
    def num_query_groups(self) -> int:
        return self.spec.num_heads // self.spec.num_kv_heads

    def new_kv_cache(self, num_slots: int, max_len: int) -> SlotKVCache:
        s = self.spec
        return SlotKVCache(1, num_slots, s.num_kv_heads, max_len, s.head_dim, self.dtype, self.device)

    def forward(
        self, embeds: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata, kv_cache: SlotKVCache
    ) -> torch.Tensor:
        """embeds (T, H) of tokens t+1, features (T, H) at t -> predicted next features (T, H)."""
        x = linear(torch.cat((embeds, features), dim=-1), self.fc_weight, self.fc_bias)
        meta.kv_scales = kv_cache.scales  # the head's own cache (model dtype), not the target's
        if self.fused.accepts(x, meta, kv_cache):
            return self.fused.run(x.contiguous(), meta, kv_cache)
        cos, sin = self.rope.gather(meta.positions)
        k_cache, v_cache = kv_cache.layer(0)
        return self.layer(x, cos, sin, k_cache, v_cache, meta)

    # -- checkpoint ----------------------------------------------------------------------------------
    def named_checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """HF/EAGLE names -> tensors (q/k/v and gate/up split back out of the fused weights)."""
        s, layer = self.spec, self.layer
        q, k, v = layer.qkv_weight.detach().split([s.q_size, s.kv_size, s.kv_size], dim=0)
        gate, up = layer.gate_up_weight.detach().chunk(2, dim=0)
        p = "layers.0."
        out = {
            "fc.weight": self.fc_weight.detach(),
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": layer.o_weight.detach(),
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.down_weight.detach(),
            p + "post_attention_layernorm.weight": layer.post_norm.weight.detach(),
        }
        if self.fc_bias is not None:
            out["fc.bias"] = self.fc_bias.detach()
        if self.input_norm:
            out[p + "input_layernorm.weight"] = layer.input_norm.weight.detach()
        return {name: t.contiguous() for name, t in out.items()}

    @torch.no_grad()
    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        tensors = {name.removeprefix("model."): t for name, t in tensors.items()}
        s, layer = self.spec, self.layer
        p = "layers.0."
        wanted = {
            "fc.weight": self.fc_weight,
            p + "self_attn.o_proj.weight": layer.o_weight,
            p + "mlp.down_proj.weight": layer.down_weight,
            p + "post_attention_layernorm.weight": layer.post_norm.weight,
        }
        if self.fc_bias is not None:
            wanted["fc.bias"] = self.fc_bias
        if self.input_norm:
            wanted[p + "input_layernorm.weight"] = layer.input_norm.weight
        fused = {
            "qkv": ([p + f"self_attn.{x}_proj.weight" for x in "qkv"], layer.qkv_weight),
            "gate_up": ([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], layer.gate_up_weight),
        }
        missing = [n for n in wanted if n not in tensors]
        missing += [n for names, _ in fused.values() for n in names if n not in tensors]
        if missing:
            raise ConfigError(f"EAGLE head checkpoint is missing tensors: {missing[:6]}")
        for name, param in wanted.items():
            _copy(param, tensors[name], name)
        for key, (names, param) in fused.items():
            _copy(param, torch.cat([tensors[n] for n in names], dim=0), key)
        if "draft_vocab_ids" in tensors:
            ids = tensors["draft_vocab_ids"].to(torch.long)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= s.vocab_size):
                raise ConfigError("EAGLE head draft_vocab_ids are outside the vocabulary.")
            self.draft_vocab_ids = ids.to(self.device)


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ConfigError(f"EAGLE head tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}.")
    param.copy_(tensor.to(dtype=param.dtype))


def load_eagle_head(path: str | Path, dtype: torch.dtype, device: torch.device, max_len: int) -> EagleHead:
    from safetensors.torch import load_file

    folder = Path(path).expanduser()
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the EAGLE head config in {folder}: {exc}") from exc
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"No .safetensors files in the EAGLE head folder {folder}.")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    head = EagleHead(config, dtype, device, max_len)
    head.load_checkpoint_tensors(tensors)
    return head.eval()


def save_eagle_head(
    head: EagleHead,
    out_dir: str | Path,
    *,
    nxd_layout: bool = False,
    embed_weight: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors``. ``nxd_layout`` adds the target's embedding and LM
    head (both required then) and drops the truncated vocabulary, for NxD Inference's EAGLE draft."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = head.named_checkpoint_tensors()
    config = json.loads(json.dumps(head.config))
    if nxd_layout:
        if embed_weight is None or lm_head_weight is None:
            raise ValueError("the NxD layout carries the target's embed_tokens and lm_head weights")
        # Clones: tied targets hand the same tensor twice, and safetensors refuses shared storage.
        tensors["embed_tokens.weight"] = embed_weight.detach().clone()
        tensors["lm_head.weight"] = lm_head_weight.detach().clone()
        config[EAGLE_CONFIG_KEY]["draft_vocab_size"] = None
    elif head.draft_vocab_ids is not None:
        tensors["draft_vocab_ids"] = head.draft_vocab_ids.detach().to(torch.int64)
    if dtype is not None:
        tensors = {n: t if not t.is_floating_point() else t.to(dtype) for n, t in tensors.items()}
        config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    save_file({n: t.contiguous().cpu() for n, t in tensors.items()}, str(out / WEIGHTS_FILE))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
