"""Image inputs of a request: the model's own transformers processor turns images into what the engine runs.

``ImagePromptProcessor`` loads the model's image processor (``AutoImageProcessor``: the image half of its
``AutoProcessor``) from the model folder and, off the event loop (the caller runs ``process`` in a worker
thread), resizes and patches a prompt's images and expands each image placeholder token of the prompt into
one token per merged patch, as the processor's own ``__call__`` expands ``<|image_pad|>`` in text
(``Qwen2VLProcessor.replace_image_token``; tests compare the two). The result
rides the request to the backend as ``MultiModalInputs``: patches, grids and a content hash per image.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nxdserve.errors import ConfigError, InvalidRequestError


@dataclass(frozen=True)
class MultiModalInputs:
    """A prompt's images as the processor made them, in prompt order."""

    # Qwen2-VL: (patches of all images, patch features); Mllama: (images, max tiles, C, H, W). float32
    pixel_values: torch.Tensor
    # (images, 3) int64: each image's (t, h, w) grid: Qwen2-VL's patches, Mllama's tiles (1, rows, columns)
    image_grid_thw: torch.Tensor
    image_hashes: tuple[str, ...]  # sha256 of each decoded image (mode, size, pixels): the prefix-cache key
    num_image_tokens: tuple[int, ...]  # prompt tokens each image expands to (Mllama: 1, its <|image|>)
    image_offsets: tuple[int, ...]  # where each image's tokens start in the prompt
    # Mllama's tiling (MllamaImageProcessor): each image's aspect ratio id, tile mask and tile count.
    aspect_ratio_ids: torch.Tensor | None = None  # (images,) int64
    aspect_ratio_mask: torch.Tensor | None = None  # (images, max tiles) int64
    num_tiles: tuple[int, ...] | None = None

    @property
    def cross_attention(self) -> bool:
        """The model attends to the images from cross-attention layers (Mllama), not from prompt tokens."""
        return self.num_tiles is not None

    @property
    def num_images(self) -> int:
        return len(self.image_hashes)


def image_hash(image: Any) -> str:
    """sha256 over a PIL image's mode, size and pixels: equal images hash equal whatever their encoding."""
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


class ImagePromptProcessor:
    """The served model's processor: images -> patches and grids; placeholder tokens -> one per image token."""

    def __init__(self, model_path: Path, image_token_id: int) -> None:
        from transformers import AutoImageProcessor

        # The image half of the model's AutoProcessor: its video half (unused) needs torchvision.
        try:
            self.image_processor: Any = AutoImageProcessor.from_pretrained(str(model_path), local_files_only=True)
        except Exception as exc:  # transformers raises many types for a folder without a processor
            raise ConfigError(
                f"cannot load the image processor (preprocessor_config.json) from {model_path}: {exc}"
            ) from exc
        self.image_token_id = image_token_id
        self.merge_size = int(getattr(self.image_processor, "merge_size", 1))
        # Mllama's processor tiles images; its prompts keep one <|image|> token per image (cross-attention).
        self.tiles = hasattr(self.image_processor, "max_image_tiles")

    def process(self, token_ids: list[int], images: Sequence[Any]) -> tuple[list[int], MultiModalInputs]:
        """(the prompt's token ids with each image's placeholder expanded, its images' inputs). A placeholder
        is a run of image tokens: one token (a chat template's or a vLLM prompt's), or already as many as its
        image takes. Mllama's prompts are not expanded: each image is one ``<|image|>`` token."""
        try:
            out = self.image_processor(images=list(images), return_tensors="pt")
        except (ValueError, TypeError, OSError) as exc:  # e.g. an aspect ratio the processor refuses
            raise InvalidRequestError(f"multi_modal_data.image: the processor refused an image: {exc}",
                                      param="multi_modal_data.image") from exc  # fmt: skip
        if self.tiles:
            return token_ids, self._tiled_inputs(token_ids, images, out)
        grid = out["image_grid_thw"].to(torch.int64)
        counts = tuple(int(n) // self.merge_size**2 for n in grid.prod(dim=-1).tolist())
        expanded, offsets = self._expand(token_ids, counts)
        inputs = MultiModalInputs(
            pixel_values=out["pixel_values"].to(torch.float32),
            image_grid_thw=grid,
            image_hashes=tuple(image_hash(image) for image in images),
            num_image_tokens=counts,
            image_offsets=offsets,
        )
        return expanded, inputs

    def _tiled_inputs(self, token_ids: list[int], images: Sequence[Any], out: Any) -> MultiModalInputs:
        """Mllama: the processor's tiles (one prompt: batch row 0) and each image token's place."""
        offsets = tuple(i for i, token in enumerate(token_ids) if token == self.image_token_id)
        if len(offsets) != len(images):
            raise InvalidRequestError(
                f"the prompt has {len(offsets)} image token(s) but {len(images)} image(s) were given; each image needs "
                "one image token where it goes (the chat template puts them there).",
                param="multi_modal_data.image",
            )
        from transformers.models.mllama.image_processing_pil_mllama import get_all_supported_aspect_ratios

        ratio_ids = out["aspect_ratio_ids"][0].to(torch.int64)
        ratios = get_all_supported_aspect_ratios(int(self.image_processor.max_image_tiles))
        grid = torch.tensor([[1, *ratios[int(i) - 1]] for i in ratio_ids.tolist()], dtype=torch.int64)
        return MultiModalInputs(
            pixel_values=out["pixel_values"][0].to(torch.float32),
            image_grid_thw=grid,
            image_hashes=tuple(image_hash(image) for image in images),
            num_image_tokens=(1,) * len(images),
            image_offsets=offsets,
            aspect_ratio_ids=ratio_ids,
            aspect_ratio_mask=out["aspect_ratio_mask"][0].to(torch.int64),
            num_tiles=tuple(int(n) for n in out["num_tiles"][0]),
        )

    def _expand(self, token_ids: list[int], counts: tuple[int, ...]) -> tuple[list[int], tuple[int, ...]]:
        image = self.image_token_id
        out: list[int] = []
        offsets: list[int] = []
        runs = 0
        i = 0
        while i < len(token_ids):
            if token_ids[i] != image:
                out.append(token_ids[i])
                i += 1
                continue
            end = i
            while end < len(token_ids) and token_ids[end] == image:
                end += 1
            if runs < len(counts) and end - i not in (1, counts[runs]):
                raise InvalidRequestError(
                    f"image {runs} takes {counts[runs]} image tokens, but its placeholder in the prompt has {end - i}.",
                    param="prompt",
                )
            offsets.append(len(out))
            out.extend([image] * (counts[runs] if runs < len(counts) else end - i))
            runs += 1
            i = end
        if runs != len(counts):
            raise InvalidRequestError(
                f"the prompt has {runs} image placeholder(s) but {len(counts)} image(s) were given; each image needs "
                "one image placeholder token where it goes (the chat template puts them there).",
                param="multi_modal_data.image",
            )
        return out, tuple(offsets)
