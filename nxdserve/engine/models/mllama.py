"""Llama 3.2 Vision (Mllama) on the torch backend: transformers' vision tower and projector, our Llama decoder
with Mllama's gated cross-attention layers between its self-attention layers.

The prompt holds one ``<|image|>`` token per image (no expansion). Each image's tiles go through the vision
tower once, at admission (the step's new requests batched into one call); each cross-attention layer's
keys and values over them are computed then and kept per slot (``SlotCrossStates``, in
``PersistentBatch.images``) for the request's life. The slot KV cache holds the self-attention layers only,
unchanged. A step's tokens of image rows run every cross-attention layer against their own slot's keys; rows
without images skip those layers, as transformers does for prompts without images (so a step without image
rows takes the plain and fused decoder paths).

Masking follows transformers' ``modeling_mllama`` exactly (``_prepare_cross_attention_mask`` over the
processor's ``cross_attention_mask``): a token attends to the tiles of the images whose ``<|image|>`` is at
or before it (up to the next image's, or to the end); a token that attends to none (text before the first
image) is a "full text row": its attention mask is dropped (it attends to every key, padding tiles too) and
its cross-attention MLP output is zeroed, while its attention output is kept. Generated tokens attend as the
prompt's last token (``generate`` repeats the last mask row).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nxdserve.engine.models.attention import AttentionMetadata, SlotKVCache
from nxdserve.engine.models.linear import linear
from nxdserve.engine.models.llama import _ACTIVATIONS, LlamaFamilyModel, RMSNorm, _iter_safetensors, _param
from nxdserve.engine.models.spec import ModelSpec
from nxdserve.errors import ConfigError

if TYPE_CHECKING:
    from nxdserve.engine.mm_inputs import MultiModalInputs
    from nxdserve.engine.persistent_batch import PersistentBatch

MODEL_TYPES = frozenset({"mllama"})


@dataclass
class SlotCrossStates:
    """One running request's images as its slot keeps them: per cross-attention layer, keys and values over all
    its images' vision tokens, and which of them each prompt position attends to."""

    keys: list[torch.Tensor]  # per cross layer (kv heads, vision tokens, head_dim)
    values: list[torch.Tensor]
    patterns: torch.Tensor  # (U, vision tokens) bool: the distinct attention rows (full text rows: all True)
    attends: torch.Tensor  # (U,) model dtype: 1 for a row that attends to an image, 0 for a full text row
    pattern_of: np.ndarray  # (prompt len,) int64: each prompt position's row of ``patterns``
    delta: int = 0  # tokens rotate at their index (plain RoPE; ``PersistentBatch.rope_delta`` stays 0)


@dataclass
class CrossStep:
    """A forward's image tokens, grouped by slot: token indices into the flat batch and their mask rows."""

    groups: list[tuple[torch.Tensor, SlotCrossStates, torch.Tensor]]  # (token index, slot's states, pattern rows)
    index: torch.Tensor  # all groups' token indices, concatenated


def cross_attention_rows(
    token_ids: Sequence[int], image_token_id: int, num_tiles: Sequence[int], max_tiles: int, tile_tokens: int
) -> np.ndarray:
    """(prompt len, images x max_tiles x tile_tokens) bool: which vision tokens each prompt position attends to,
    from transformers' own processor functions (the mask ``MllamaProcessor`` returns)."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    ids = list(token_ids)
    spans = get_cross_attention_token_mask(ids, image_token_id)
    if len(spans) != len(num_tiles):
        raise ValueError(f"{len(spans)} image tokens in the prompt but {len(num_tiles)} images")
    dense = convert_sparse_cross_attention_mask_to_dense([spans], [list(num_tiles)], max_tiles, len(ids))[0]
    return np.repeat(dense.reshape(len(ids), -1).astype(bool), tile_tokens, axis=1)


class CrossAttentionLayer(nn.Module):
    """Mllama's cross-attention decoder layer (tanh-gated attention over the image, q/k RMSNorm per head, and a
    tanh-gated MLP), over the image tokens of a step only."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        s = spec
        self.spec = spec
        self.input_norm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype, device)
        self.q_weight = _param(s.q_size, s.hidden_size, dtype=dtype, device=device)
        self.kv_weight = _param(2 * s.kv_size, s.hidden_size, dtype=dtype, device=device)
        self.o_weight = _param(s.hidden_size, s.q_size, dtype=dtype, device=device)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps, dtype, device)
        self.attn_gate = _param(1, dtype=dtype, device=device)
        self.post_norm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype, device)
        self.gate_up_weight = _param(2 * s.intermediate_size, s.hidden_size, dtype=dtype, device=device)
        self.down_weight = _param(s.hidden_size, s.intermediate_size, dtype=dtype, device=device)
        self.mlp_gate = _param(1, dtype=dtype, device=device)
        self.act = _ACTIVATIONS[s.hidden_act]

    def image_kv(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected vision tokens (N, hidden) -> keys, values (kv heads, N, head_dim)."""
        s = self.spec
        kv = linear(states, self.kv_weight)
        k = self.k_norm(kv[:, : s.kv_size].view(-1, s.num_kv_heads, s.head_dim))
        v = kv[:, s.kv_size :].view(-1, s.num_kv_heads, s.head_dim)
        return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()

    def forward(self, x: torch.Tensor, step: CrossStep, layer: int) -> torch.Tensor:
        """x (T, hidden): the step's tokens; only ``step``'s image tokens change."""
        s = self.spec
        residual = x[step.index]
        h = self.input_norm(residual)
        q = self.q_norm(linear(h, self.q_weight).view(-1, s.num_heads, s.head_dim))
        attn = torch.empty_like(q)
        attends = torch.empty(residual.shape[0], 1, dtype=x.dtype, device=x.device)
        start = 0
        for index, states, rows in step.groups:
            n = index.numel()
            qs = q[start : start + n].transpose(0, 1)  # (heads, n, head_dim)
            out = F.scaled_dot_product_attention(
                qs, states.keys[layer], states.values[layer], attn_mask=states.patterns[rows],
                enable_gqa=s.num_heads != s.num_kv_heads,
            )  # fmt: skip
            attn[start : start + n] = out.transpose(0, 1)
            attends[start : start + n, 0] = states.attends[rows]
            start += n
        o = linear(attn.reshape(-1, s.q_size), self.o_weight)
        hidden = residual + self.attn_gate.tanh() * o
        gate, up = linear(self.post_norm(hidden), self.gate_up_weight).chunk(2, dim=-1)
        mlp = linear(self.act(gate) * up, self.down_weight) * attends  # full text rows: no MLP
        hidden = hidden + self.mlp_gate.tanh() * mlp
        return x.index_copy(0, step.index, hidden)


class MllamaDecoder(LlamaFamilyModel):
    """The self-attention layers (``LlamaFamilyModel``: slot KV cache, fused paths) with the cross-attention
    layers run between them when a forward has image tokens (``cross_step``, set for one forward)."""

    def __init__(
        self, spec: ModelSpec, text_config: Any, cross_layers: Sequence[int], dtype: torch.dtype,
        device: torch.device, max_len: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(spec, text_config, dtype, device, max_len)
        if spec.tie_word_embeddings:
            raise ConfigError("Mllama with tied embeddings is not supported.")
        # Mllama's embedding has 8 rows past the vocabulary (the image token's among them); the head does not.
        self.embed_weight = _param(spec.vocab_size + 8, spec.hidden_size, dtype=dtype, device=device)
        self.cross_positions = tuple(sorted(int(i) for i in cross_layers))
        self.cross_layers = nn.ModuleList(CrossAttentionLayer(spec, dtype, device) for _ in self.cross_positions)
        self.cross_step: CrossStep | None = None

    def layer_order(self) -> list[tuple[str, int]]:
        """The decoder's layers in order: ("self", index in the slot KV) or ("cross", index among cross layers)."""
        order: list[tuple[str, int]] = []
        num_self = num_cross = 0
        for i in range(len(self.layers) + len(self.cross_layers)):
            if i in self.cross_positions:
                order.append(("cross", num_cross))
                num_cross += 1
            else:
                order.append(("self", num_self))
                num_self += 1
        return order

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: SlotKVCache,
        keep: torch.Tensor | None = None,
        on_compute: Callable[[], None] | None = None,
        embeds: torch.Tensor | None = None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        step, self.cross_step = self.cross_step, None
        if step is None:  # no image tokens: cross-attention layers are skipped, as transformers skips them
            return super().forward(token_ids, meta, kv_cache, keep, on_compute, embeds, cos_sin)
        alts = meta.alts
        if keep is not None and alts is not None:
            raise ValueError("keep cannot be combined with draft alternatives")
        if alts is not None:
            s = self.spec
            alts.kv = torch.empty(
                s.num_layers, alts.count, 2, s.num_kv_heads, s.head_dim, dtype=self.dtype, device=self.device
            )
        x = F.embedding(token_ids, self.embed_weight) if embeds is None else embeds
        positions = meta.positions if alts is None else torch.cat((meta.positions, alts.positions))
        cos, sin = self.rope.gather(positions) if cos_sin is None else cos_sin
        if on_compute is not None:
            on_compute()
        for kind, i in self.layer_order():
            if kind == "cross":
                x = self.cross_layers[i](x, step, i)
            else:
                k_cache, v_cache = kv_cache.layer(i)
                x = self.layers[i](x, cos, sin, k_cache, v_cache, meta)
        return self.norm(x if keep is None else x[keep.to(x.device)])


class MllamaModel(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device, max_len: int | None = None) -> None:
        super().__init__()
        from transformers.models.mllama.modeling_mllama import MllamaVisionModel

        text_config = copy.deepcopy(hf_config.text_config)
        cross_layers = list(text_config.cross_attention_layers)
        text_config.model_type = "llama"  # the self-attention layers are Llama's
        text_config.num_hidden_layers = int(text_config.num_hidden_layers) - len(cross_layers)
        spec = ModelSpec.from_hf_config(text_config)
        self.text = MllamaDecoder(spec, text_config, cross_layers, dtype, device, max_len)
        vision = MllamaVisionModel(hf_config.vision_config)
        # transformers types PreTrainedModel.to with its own decorator, which mypy cannot call through.
        self.vision = vision.to(dtype=dtype, device=device)  # type: ignore[call-arg]
        self.vision.eval()
        self.projector = nn.Linear(
            int(hf_config.vision_config.vision_output_dim), spec.hidden_size, bias=True, dtype=dtype, device=device
        )
        self.image_token_id = int(hf_config.image_token_index)
        self.max_tiles = int(hf_config.vision_config.max_num_tiles)
        self.tile_tokens = int(self.vision.num_patches)  # vision tokens a tile: patches + the class token
        self.dtype, self.device = dtype, device
        self.num_images_encoded = 0  # images run through the vision tower (recurring ones once per admitting step)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype, device: torch.device, max_len: int | None = None
    ) -> MllamaModel:
        from nxdserve.model_files import load_hf_config

        model = cls(load_hf_config(path), dtype, device, max_len)
        model.load_weights(_iter_safetensors(Path(path)))
        return model

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF Mllama checkpoint names (``language_model.model.*``, ``vision_model.*``, ``multi_modal_projector.*``,
        and transformers 5's ``model.``-prefixed ones)."""
        vision: dict[str, torch.Tensor] = {}
        projector: dict[str, torch.Tensor] = {}
        cross: dict[tuple[int, str], torch.Tensor] = {}
        order = self.text.layer_order()

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.") if name.startswith("model.language_model.") else name
                name = name.removeprefix("model.") if name.startswith(("model.vision_model.", "model.multi_")) else name
                if name.startswith("vision_model."):
                    vision[name.removeprefix("vision_model.")] = tensor
                elif name.startswith("multi_modal_projector."):
                    projector[name.removeprefix("multi_modal_projector.")] = tensor
                elif name in ("language_model.lm_head.weight", "lm_head.weight"):
                    yield "lm_head.weight", tensor
                elif name.startswith("language_model.model.layers."):
                    index, local = name.removeprefix("language_model.model.layers.").split(".", 1)
                    kind, i = order[int(index)]
                    if kind == "cross":
                        cross[(i, local)] = tensor
                    else:
                        yield f"model.layers.{i}.{local}", tensor
                elif name.startswith("language_model.model."):
                    yield "model." + name.removeprefix("language_model.model."), tensor
                else:
                    raise ConfigError(f"Unexpected checkpoint tensor {name!r} for an Mllama model.")

        self.text.load_weights(text_weights())
        for i, layer in enumerate(self.text.cross_layers):
            assert isinstance(layer, CrossAttentionLayer)
            try:
                parts = {
                    layer.input_norm.weight: cross.pop((i, "input_layernorm.weight")),
                    layer.q_weight: cross.pop((i, "cross_attn.q_proj.weight")),
                    layer.kv_weight: torch.cat((cross.pop((i, "cross_attn.k_proj.weight")),
                                                cross.pop((i, "cross_attn.v_proj.weight")))),
                    layer.o_weight: cross.pop((i, "cross_attn.o_proj.weight")),
                    layer.q_norm.weight: cross.pop((i, "cross_attn.q_norm.weight")),
                    layer.k_norm.weight: cross.pop((i, "cross_attn.k_norm.weight")),
                    layer.attn_gate: cross.pop((i, "cross_attn_attn_gate")),
                    layer.post_norm.weight: cross.pop((i, "post_attention_layernorm.weight")),
                    layer.gate_up_weight: torch.cat((cross.pop((i, "mlp.gate_proj.weight")),
                                                     cross.pop((i, "mlp.up_proj.weight")))),
                    layer.down_weight: cross.pop((i, "mlp.down_proj.weight")),
                    layer.mlp_gate: cross.pop((i, "cross_attn_mlp_gate")),
                }  # fmt: skip
            except KeyError as exc:
                raise ConfigError(f"Checkpoint is missing cross-attention tensor {exc} of layer {i}") from None
            for param, tensor in parts.items():
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ConfigError(f"Cross-attention tensor of shape {tuple(tensor.shape)}, expected "
                                      f"{tuple(param.shape)}")  # fmt: skip
                param.copy_(tensor)
        if cross:
            raise ConfigError(f"Unexpected cross-attention tensors: {sorted(k for _, k in cross)[:4]}")
        for module, state, what in ((self.vision, vision, "Vision"), (self.projector, projector, "Projector")):
            missing, unexpected = module.load_state_dict(state, strict=False)
            if missing or unexpected:
                raise ConfigError(f"{what} weights do not match: missing {missing[:4]}, unexpected {unexpected[:4]}")

    @torch.inference_mode()
    def encode_images(
        self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor, aspect_ratio_mask: torch.Tensor
    ) -> torch.Tensor:
        """Images (N, tiles, C, H, W) -> projected vision tokens (N, tiles x tile tokens, hidden)."""
        out = self.vision(
            pixel_values=pixel_values[None].to(self.device, self.dtype),
            aspect_ratio_ids=aspect_ratio_ids[None].to(self.device),
            aspect_ratio_mask=aspect_ratio_mask[None].to(self.device),
        ).last_hidden_state  # (1, N, tiles, tile tokens, vision dim)
        n = pixel_values.shape[0]
        return self.projector(out).reshape(n, -1, self.text.spec.hidden_size)

    @torch.inference_mode()
    def cross_states(self, token_ids: Sequence[int], mm: MultiModalInputs, features: torch.Tensor) -> SlotCrossStates:
        """A prompt's per-slot state from its images' projected vision tokens (images, vision tokens, hidden)."""
        assert mm.num_tiles is not None
        rows = cross_attention_rows(token_ids, self.image_token_id, mm.num_tiles, self.max_tiles, self.tile_tokens)
        attends = rows.any(axis=1)
        rows[~attends] = True  # a full text row: transformers drops its mask (and zeroes its MLP)
        # The flag column keeps a full text row apart from an image row that attends to every key.
        unique, pattern_of = np.unique(np.column_stack((rows, attends)), axis=0, return_inverse=True)
        states = features.reshape(-1, features.shape[-1])
        keys, values = [], []
        for layer in self.text.cross_layers:
            assert isinstance(layer, CrossAttentionLayer)
            k, v = layer.image_kv(states)
            keys.append(k)
            values.append(v)
        return SlotCrossStates(
            keys=keys,
            values=values,
            patterns=torch.from_numpy(np.ascontiguousarray(unique[:, :-1])).to(self.device),
            attends=torch.from_numpy(unique[:, -1].astype(np.float32)).to(self.dtype).to(self.device),
            pattern_of=pattern_of.reshape(-1).astype(np.int64),
        )

    @torch.inference_mode()
    def encode_new(self, prompts: Sequence[tuple[Sequence[int], MultiModalInputs]]) -> list[SlotCrossStates]:
        """Each admitted prompt's images through the vision tower, all in one call, and each prompt's
        cross-attention keys and values. An image that recurs among them (same content hash) is encoded once."""
        unique: dict[str, int] = {}
        pixels: list[torch.Tensor] = []
        ratio_ids: list[torch.Tensor] = []
        ratio_masks: list[torch.Tensor] = []
        picks: list[list[int]] = []
        for _, mm in prompts:
            assert mm.aspect_ratio_ids is not None and mm.aspect_ratio_mask is not None
            pick = []
            for k, digest in enumerate(mm.image_hashes):
                if digest not in unique:
                    unique[digest] = len(pixels)
                    pixels.append(mm.pixel_values[k])
                    ratio_ids.append(mm.aspect_ratio_ids[k])
                    ratio_masks.append(mm.aspect_ratio_mask[k])
                pick.append(unique[digest])
            picks.append(pick)
        features = self.encode_images(torch.stack(pixels), torch.stack(ratio_ids), torch.stack(ratio_masks))
        self.num_images_encoded += len(pixels)
        return [
            self.cross_states(token_ids, mm, features[pick])
            for (token_ids, mm), pick in zip(prompts, picks, strict=True)
        ]

    def step_inputs(
        self, token_ids: torch.Tensor, token_slots: np.ndarray, positions: np.ndarray, batch: PersistentBatch
    ) -> tuple[None, None]:
        """Sets the next forward's cross-attention inputs (the image rows' tokens, by slot, with their mask
        rows; a position past the prompt takes the prompt's last row). Embeddings and RoPE are the plain ones."""
        image_tokens = np.flatnonzero(batch.has_images[token_slots])
        groups = []
        for slot in np.unique(token_slots[image_tokens]).tolist():
            at = image_tokens[token_slots[image_tokens] == slot]
            states: SlotCrossStates = batch.images[slot]
            pos = np.minimum(positions[at], states.pattern_of.size - 1)
            groups.append((
                torch.from_numpy(at).to(self.device), states,
                torch.from_numpy(states.pattern_of[pos]).to(self.device),
            ))  # fmt: skip
        self.text.cross_step = CrossStep(groups, torch.cat([g[0] for g in groups])) if groups else None
        return None, None

    @torch.inference_mode()
    def prefill_logits(
        self,
        token_ids: Sequence[int],
        mm: MultiModalInputs | None,
    ) -> torch.Tensor:
        """float32 logits (T, vocab) of one prompt with its images."""
        from nxdserve.engine.persistent_batch import PersistentBatch

        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=self.device)
        n = ids.numel()
        spec = self.text.spec
        kv = self.text.new_kv_cache(1, n)
        meta = AttentionMetadata.build(
            np.array([0]), np.array([0]), np.array([n]), num_query_groups=spec.num_heads // spec.num_kv_heads,
            windows=self.text.windows, max_len=n, device=self.device, dtype=self.dtype, attention_kernel=False,
        )  # fmt: skip
        if mm is not None:
            batch = PersistentBatch(1, n + 1)
            batch.has_images[0] = True
            batch.images[0] = self.encode_new([(token_ids, mm)])[0]
            self.step_inputs(ids, np.zeros(n, dtype=np.int64), np.arange(n), batch)
        hidden = self.text.forward(ids, meta, kv)
        return self.text.compute_logits(hidden)
