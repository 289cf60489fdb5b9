"""Qwen2-VL on the torch backend: transformers' vision encoder, our Llama-family decoder with M-RoPE.

Images are encoded once each (transformers' ``Qwen2VisionTransformerPretrainedModel``, patches merged 2x2
into one token each) and their features replace the embeddings of the prompt's image-pad tokens. The
decoder is the Qwen2 one of ``llama.py``; only its rotary tables differ: multimodal RoPE rotates each
head_dim section by one of three position streams (time, row, column). Text tokens have the same value
in all three, so after the last image a token at sequence index ``i`` rotates exactly as plain RoPE at
``i + delta`` (``delta`` from ``mrope_positions``); image tokens take their grid coordinates.

The torch backend drives it per slot: ``encode_new`` runs the encoder once per admitted request (the
step's new requests batched into one call) and keeps each request's features and positions
(``SlotImages``) in the persistent batch for its life; ``step_inputs`` builds a step's input embeddings
(image features at image-token positions, a chunk taking its slice) and its rotary tables. Decode rows
rotate at ``i + delta``. ``prefill_logits`` runs one prompt alone (the model-level tests).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nxdserve.engine.models.attention import AttentionMetadata
from nxdserve.engine.models.llama import LlamaFamilyModel, _iter_safetensors
from nxdserve.engine.models.rope import rope_inv_freq
from nxdserve.engine.models.spec import ModelSpec
from nxdserve.errors import ConfigError

if TYPE_CHECKING:
    from nxdserve.engine.mm_inputs import MultiModalInputs
    from nxdserve.engine.persistent_batch import PersistentBatch

MODEL_TYPES = frozenset({"qwen2_vl"})


@dataclass
class SlotImages:
    """One running request's images, as its slot keeps them (``PersistentBatch.images``)."""

    features: torch.Tensor  # (image tokens, hidden) encoder output, model dtype, on the model's device
    feature_index: np.ndarray  # (prompt len,) int64: each prompt position's row of ``features``, -1 for text
    positions: np.ndarray  # (3, prompt len) int64 M-RoPE positions
    delta: int  # tokens past the prompt rotate at index + delta


def mrope_positions(
    token_ids: Sequence[int], image_grid_thw: Sequence[Sequence[int]], image_token_id: int, merge_size: int
) -> tuple[np.ndarray, int]:
    """(positions (3, T) int64, delta): the three position streams of a prompt, and the offset that the
    tokens after it add to their sequence index. Each run of image tokens is one image, in grid order."""
    ids = np.asarray(token_ids, dtype=np.int64)
    positions = np.empty((3, ids.size), dtype=np.int64)
    grids = iter(image_grid_thw)
    cur, i = 0, 0
    while i < ids.size:
        if ids[i] != image_token_id:
            positions[:, i] = cur
            cur, i = cur + 1, i + 1
            continue
        try:
            t, h, w = (int(v) for v in next(grids))
        except StopIteration:
            raise ValueError("the prompt has more image runs than images") from None
        h, w = h // merge_size, w // merge_size
        n = t * h * w
        if ids[i : i + n].size != n or not (ids[i : i + n] == image_token_id).all():
            raise ValueError(f"an image of {n} tokens does not match the prompt's image-token run at {i}")
        grid = np.indices((t, h, w)).reshape(3, n)
        positions[:, i : i + n] = grid + cur
        cur, i = int(positions[:, i : i + n].max()) + 1, i + n
    if next(grids, None) is not None:
        raise ValueError("more images than image-token runs in the prompt")
    return positions, cur - int(ids.size)


class MRopeTables:
    """cos/sin (T, 1, head_dim) for three position streams, each head_dim section taken from its stream."""

    def __init__(self, inv_freq: torch.Tensor, mrope_section: Sequence[int], dtype: torch.dtype) -> None:
        self.inv_freq = inv_freq
        # Sections count rotation pairs; the rotate-half layout repeats them for the second half.
        sections = list(mrope_section) * 2
        if sum(sections) != inv_freq.numel() * 2:
            raise ConfigError(f"mrope_section {list(mrope_section)} does not cover head_dim {inv_freq.numel() * 2}")
        self.stream_of_dim = torch.cat([torch.full((n,), k % 3) for k, n in enumerate(sections)])
        self.dtype = dtype

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (3, T) -> cos, sin (T, 1, head_dim)."""
        freqs = positions.to(torch.float32)[:, :, None] * self.inv_freq.to(positions.device)[None, None, :]
        angles = torch.cat((freqs, freqs), dim=-1)  # (3, T, head_dim)
        pick = self.stream_of_dim.to(positions.device)[None, None, :].expand(1, angles.shape[1], -1)
        chosen = angles.gather(0, pick)[0]  # (T, head_dim): each dim from its stream
        return chosen.cos().to(self.dtype).unsqueeze(1), chosen.sin().to(self.dtype).unsqueeze(1)


class Qwen2VLModel(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device, max_len: int | None = None) -> None:
        super().__init__()
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        text_config = copy.deepcopy(hf_config.text_config)
        text_config.model_type = "qwen2"  # the decoder is Qwen2's; only its rotary positions are multimodal
        params = dict(getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {})
        mrope_section = params.get("mrope_section")
        if not mrope_section:
            raise ConfigError("Qwen2-VL config has no rope mrope_section.")
        spec = ModelSpec.from_hf_config(text_config)
        self.text = LlamaFamilyModel(spec, text_config, dtype, device, max_len)
        inv_freq, scaling = rope_inv_freq(text_config, spec.head_dim, "default")
        if scaling != 1.0:
            raise ConfigError("Scaled multimodal RoPE is not supported.")
        self.mrope = MRopeTables(inv_freq, mrope_section, dtype)
        visual = Qwen2VisionTransformerPretrainedModel(hf_config.vision_config)
        # transformers types PreTrainedModel.to with its own decorator, which mypy cannot call through.
        self.visual = visual.to(dtype=dtype, device=device)  # type: ignore[call-arg]
        self.visual.eval()
        self.image_token_id = int(hf_config.image_token_id)
        self.merge_size = int(hf_config.vision_config.spatial_merge_size)
        self.dtype, self.device = dtype, device
        self.num_images_encoded = 0  # images run through the encoder (recurring ones once per admitting step)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype, device: torch.device, max_len: int | None = None
    ) -> Qwen2VLModel:
        from nxdserve.model_files import load_hf_config

        model = cls(load_hf_config(path), dtype, device, max_len)
        model.load_weights(_iter_safetensors(Path(path)))
        return model

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint names of transformers 5 (``model.language_model.*``, ``model.visual.*``) and 4
        (``model.*``, ``visual.*``)."""
        visual: dict[str, torch.Tensor] = {}

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for prefix in ("model.visual.", "visual."):
                    if name.startswith(prefix):
                        visual[name[len(prefix) :]] = tensor
                        break
                else:
                    yield name.replace("model.language_model.", "model.", 1), tensor

        self.text.load_weights(text_weights())
        missing, unexpected = self.visual.load_state_dict(visual, strict=False)
        if missing or unexpected:
            raise ConfigError(f"Vision weights do not match: missing {missing[:4]}, unexpected {unexpected[:4]}")

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """The processor's patches -> one feature row per image token (all images, in order)."""
        out = self.visual(pixel_values.to(self.device, self.dtype), grid_thw=image_grid_thw.to(self.device))
        features = out if isinstance(out, torch.Tensor) else out.pooler_output
        return features

    @torch.inference_mode()
    def encode_new(self, prompts: Sequence[tuple[Sequence[int], MultiModalInputs]]) -> list[SlotImages]:
        """Each admitted prompt's images through the encoder, all in one call (the encoder attends within
        each image), and its M-RoPE positions. An image that recurs among them (same content hash: within a
        prompt, or across requests admitted together, such as n > 1 choices) is encoded once."""
        unique: dict[str, int] = {}  # content hash -> index among the images encoded
        pixels: list[torch.Tensor] = []
        grids: list[torch.Tensor] = []
        picks: list[list[int]] = []
        for _, mm in prompts:
            patch_ends = mm.image_grid_thw.prod(dim=-1).cumsum(0).tolist()
            pick = []
            for k, digest in enumerate(mm.image_hashes):
                if digest not in unique:
                    unique[digest] = len(pixels)
                    pixels.append(mm.pixel_values[(patch_ends[k - 1] if k else 0) : patch_ends[k]])
                    grids.append(mm.image_grid_thw[k])
                pick.append(unique[digest])
            picks.append(pick)
        grid = torch.stack(grids)
        features = self.encode_images(torch.cat(pixels), grid).split(
            (grid.prod(dim=-1) // self.merge_size**2).tolist()
        )
        self.num_images_encoded += len(pixels)
        out = []
        for (token_ids, mm), pick in zip(prompts, picks, strict=True):
            ids = np.asarray(token_ids, dtype=np.int64)
            n = sum(mm.num_image_tokens)
            at_images = ids == self.image_token_id
            if int(at_images.sum()) != n:
                raise ValueError(f"{int(at_images.sum())} image tokens in the prompt but {n} image features")
            feature_index = np.full(ids.size, -1, dtype=np.int64)
            feature_index[at_images] = np.arange(n)
            image_grids = mm.image_grid_thw.tolist()
            positions, delta = mrope_positions(token_ids, image_grids, self.image_token_id, self.merge_size)
            out.append(SlotImages(torch.cat([features[u] for u in pick]), feature_index, positions, delta))
        return out

    @torch.inference_mode()
    def step_inputs(
        self, token_ids: torch.Tensor, token_slots: np.ndarray, positions: np.ndarray, batch: PersistentBatch
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """A step's input embeddings (T, hidden) and cos/sin, for tokens of slots at sequence ``positions``:
        prompt tokens of image rows take their image features and M-RoPE positions (a chunk its slice);
        every other token rotates at its position + its slot's delta (0 for text rows)."""
        embeds = F.embedding(token_ids.to(self.device), self.text.embed_weight)
        rope = np.broadcast_to(positions + batch.rope_delta[token_slots], (3, positions.size)).copy()
        in_prompt = np.flatnonzero(batch.has_images[token_slots] & (positions < batch.num_prompt_tokens[token_slots]))
        for slot in np.unique(token_slots[in_prompt]).tolist():  # the image rows still in their prompt: few
            at = in_prompt[token_slots[in_prompt] == slot]
            state: SlotImages = batch.images[slot]
            pos = positions[at]
            rope[:, at] = state.positions[:, pos]
            rows = state.feature_index[pos]
            hit = rows >= 0
            if hit.any():
                embeds[torch.from_numpy(at[hit]).to(self.device)] = state.features[
                    torch.from_numpy(rows[hit]).to(self.device)
                ].to(embeds.dtype)
        return embeds, self.mrope.gather(torch.from_numpy(rope).to(self.device))

    @torch.inference_mode()
    def prefill_logits(
        self, token_ids: Sequence[int], pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None
    ) -> torch.Tensor:
        """float32 logits (T, vocab) of one prompt, images merged at its image-token positions."""
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=self.device)
        embeds = F.embedding(ids, self.text.embed_weight)
        grids: list[list[int]] = []
        if pixel_values is not None and image_grid_thw is not None:
            grids = image_grid_thw.tolist()
            features = self.encode_images(pixel_values, image_grid_thw)
            at_images = ids == self.image_token_id
            if int(at_images.sum()) != features.shape[0]:
                raise ValueError(f"{int(at_images.sum())} image tokens but {features.shape[0]} image features")
            embeds = embeds.masked_scatter(at_images[:, None], features.to(embeds.dtype))
        positions, _ = mrope_positions(token_ids, grids, self.image_token_id, self.merge_size)
        cos_sin = self.mrope.gather(torch.from_numpy(positions).to(self.device))
        n = ids.numel()
        spec = self.text.spec
        kv = self.text.new_kv_cache(1, n)
        meta = AttentionMetadata.build(
            np.array([0]), np.array([0]), np.array([n]), num_query_groups=spec.num_heads // spec.num_kv_heads,
            windows=self.text.windows, max_len=n, device=self.device, dtype=self.dtype, attention_kernel=False,
        )  # fmt: skip
        hidden = self.text.forward(ids, meta, kv, embeds=embeds, cos_sin=cos_sin)
        return self.text.compute_logits(hidden)
