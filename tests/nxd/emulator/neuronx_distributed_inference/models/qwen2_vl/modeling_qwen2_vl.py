"""NeuronQwen2VLForCausalLM: NxDI's Qwen2-VL application (models/qwen2_vl/modeling_qwen2_vl.py), registered as
NxDI registers it (MODEL_TYPES["qwen2_vl"]["causal-lm"]), with its constructor and forward signatures.

What the emulator keeps of NxDI's behaviour:
- ``Qwen2VLNeuronConfig`` adds ``default_image_width``/``default_image_height`` (640x320): the vision encoder is
  compiled for that one image size (``pixels_per_image`` patches each, transformers' ``smart_resize``), its
  ``buckets`` count images per prompt; pixel_values of another size or more images than the largest bucket
  fail as the traced encoder would;
- ``Qwen2VLInferenceConfig`` copies the text keys into ``text_config``, switches off what the text model does
  not support (fused speculation, prefix caching, chunked prefill, block KV), asserts ``fused_qkv`` on the
  vision config and that the largest vision bucket's image tokens fit the text bucket;
- ``forward``: on a context encoding with non-zero ``pixel_values`` the encoder runs, the image-token
  positions (``input_ids == image_token_id``) become ``vision_mask``; otherwise dummy vision inputs.
  ``adapter_ids`` is accepted and dropped, as NxDI's forward drops it;
- rotary positions: NxDI's text model rotates with the caller's 1-D ``position_ids`` for all three M-RoPE
  sections (``NeuronQwen2VLRotaryEmbedding`` broadcasts them), so an image token at prompt index i rotates
  at (i, i, i), not at transformers' (t, h, w) grid position.
Numerics come from nxdserve's torch Qwen2-VL model (vision encoder, decoder, rotary tables).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.image_to_text_model_base import (
    ImageToTextInferenceConfig,
    NeuronBaseForImageToText,
)
from nxdserve.engine.models.qwen2_vl import Qwen2VLModel
from nxdserve.engine.models.runner import SlotModelRunner

logger = logging.getLogger(__name__)

DEFAULT_IMAGE_WIDTH, DEFAULT_IMAGE_HEIGHT = 640, 320
QWEN2_VL_TEXT_CONFIG_KEYS = ["hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                             "pad_token_id", "vocab_size", "intermediate_size", "max_position_embeddings",
                             "rms_norm_eps", "rope_theta", "rope_scaling", "hidden_act", "bos_token_id",
                             "eos_token_id", "image_token_id", "video_token_id", "vision_start_token_id",
                             "vision_end_token_id"]  # fmt: skip
TEXT_UNSUPPORTED = ["is_block_kv_layout", "is_prefix_caching", "is_chunked_prefill", "is_medusa",
                    "enable_fused_speculation"]  # fmt: skip


def pixels_per_image(neuron_config: NeuronConfig, patch_size: int) -> int:
    height, width = smart_resize(height=int(neuron_config.default_image_height),
                                 width=int(neuron_config.default_image_width))  # fmt: skip
    return (height // patch_size) * (width // patch_size)


class Qwen2VLNeuronConfig(NeuronConfig):
    def __init__(self, **kwargs: Any) -> None:
        self.default_image_width = kwargs.pop("default_image_width", DEFAULT_IMAGE_WIDTH)
        self.default_image_height = kwargs.pop("default_image_height", DEFAULT_IMAGE_HEIGHT)
        super().__init__(**kwargs)


class Qwen2VLInferenceConfig(ImageToTextInferenceConfig):
    def __init__(self, text_neuron_config: NeuronConfig, vision_neuron_config: NeuronConfig,
                 fused_spec_config: Any = None, load_config: Any = None, metadata: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(text_neuron_config=text_neuron_config, vision_neuron_config=vision_neuron_config,
                         fused_spec_config=fused_spec_config, load_config=load_config, metadata=metadata,
                         **kwargs)  # fmt: skip
        self.qkv_bias, self.o_bias = True, False
        self.vision_config.head_dim = self.vision_config.embed_dim // self.vision_config.num_heads
        text = self.text_config
        for key in QWEN2_VL_TEXT_CONFIG_KEYS:  # top-level keys win, as NxDI copies them down
            if hasattr(self, key):
                setattr(text, key, getattr(self, key))
        self.pad_token_id = getattr(text, "pad_token_id", None)
        for flag in TEXT_UNSUPPORTED:
            if getattr(text.neuron_config, flag, False) is not False:
                setattr(text.neuron_config, flag, False)
                logger.warning("Qwen2VL text model does not yet support '%s'. Will be disabled.", flag)
        vnc = self.vision_config.neuron_config
        assert getattr(vnc, "fused_qkv", False) is True
        if vnc.buckets and text.neuron_config.buckets:
            assert vnc.buckets[-1] * pixels_per_image(vnc, self.vision_config.patch_size) // 4 <= (
                text.neuron_config.buckets[-1]
            )

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return Qwen2VLNeuronConfig


class NeuronQwen2VLTextModel:  # NxDI's traced text model class (the emulator computes with nxdserve's)
    pass


class NeuronQwen2VisionModel:  # NxDI's traced vision model class
    pass


class NeuronQwen2VLForCausalLM(NeuronBaseForImageToText):
    text_model_cls = NeuronQwen2VLTextModel
    vision_model_cls = NeuronQwen2VisionModel
    _model_cls = NeuronQwen2VLTextModel

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(self.text_model_cls, self.vision_model_cls, None, None, *args, **kwargs)
        self.vlm: Qwen2VLModel | None = None

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return Qwen2VLInferenceConfig

    def get_required_kwargs(self) -> list[str]:
        return ["pixel_values", "vision_mask", "image_grid_thw"]

    def load_weights(self, compiled_model_path: str) -> None:
        nc = self.neuron_config
        lines = nc.kv_cache_batch_size + (1 if nc.apply_seq_ids_mask else 0)
        self.vlm = Qwen2VLModel.from_pretrained(self._weights_path(), nc.torch_dtype, torch.device("cpu"),
                                                max_len=nc.max_length)  # fmt: skip
        self.target = SlotModelRunner(self.vlm.text, lines, nc.max_length)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.vlm is not None
        return self.vlm.mrope.gather(positions.long().view(1, -1).expand(3, -1))  # t = h = w: NxDI's 1-D positions

    def get_padding_length(self, input_ids: torch.Tensor) -> int:
        for bucket in self.context_encoding_model.buckets:
            if bucket >= input_ids.shape[1]:
                return bucket
        raise Exception("No bucket found for provided input_ids!")

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """The traced encoder: images padded to the first vision bucket that holds them, (1, seq_len, hidden)."""
        assert self.vlm is not None
        vc = self.vision_config
        per_image = pixels_per_image(vc.neuron_config, vc.patch_size)
        grids = image_grid_thw.long()
        if pixel_values.shape[0] != grids.shape[0] * per_image or bool((grids.prod(dim=-1) != per_image).any()):
            raise RuntimeError(f"emulator: the vision encoder was traced for images of {per_image} patches; got "
                               f"grids {grids.tolist()} ({pixel_values.shape[0]} patches)")  # fmt: skip
        fits = [b for b in vc.neuron_config.buckets if b * per_image >= pixel_values.shape[0]]
        if not fits:
            raise Exception(f"No bucket found for provided pixel_values with shape {pixel_values.shape[0]}.")
        self.vision_calls.append({"images": int(grids.shape[0]), "bucket": fits[0]})
        features = self.vlm.encode_images(pixel_values.to(vc.neuron_config.torch_dtype).float(), grids)
        out = torch.zeros(1, self.text_config.neuron_config.seq_len, features.shape[-1], dtype=features.dtype)
        out[0, : features.shape[0]] = features
        return out

    def forward(  # type: ignore[override]  # NxDI's signature
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        seq_ids: torch.Tensor | None = None,
        sampling_params: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        vision_mask: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        adapter_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: Any = None,
        medusa_args: Any = None,
        input_capture_hook: Any = None,
        tensor_capture_hook: Any = None,
        return_dict: Any = None,
    ) -> Any:
        assert input_ids is not None
        pad_limit = self.get_padding_length(input_ids)
        if pixel_values is not None and input_ids.shape[-1] > 1 and pixel_values.sum() != 0:
            assert image_grid_thw is not None
            positions = torch.nonzero(input_ids.squeeze() == int(self.text_config.image_token_id)).squeeze(-1)
            if positions.numel() > pad_limit:
                raise RuntimeError("Text model sequence length is not enough to handle all vision embeddings")
            vision_mask = torch.full((pad_limit,), pad_limit - 1, dtype=torch.int32)
            vision_mask[: positions.numel()] = positions.to(torch.int32)
            vision_mask = vision_mask.view(1, pad_limit, 1)
            vision_embeddings = self.encode_images(pixel_values, image_grid_thw)
        else:
            vision_embeddings, vision_mask = torch.zeros(0), torch.zeros(0, dtype=torch.bool)
        return NeuronBaseForImageToText.forward(
            self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, seq_ids=seq_ids,
            sampling_params=sampling_params, input_capture_hook=input_capture_hook,
            tensor_capture_hook=tensor_capture_hook, vision_embeddings=vision_embeddings, vision_mask=vision_mask,
        )  # fmt: skip

    __call__ = forward


