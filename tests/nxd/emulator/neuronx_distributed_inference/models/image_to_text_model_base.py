"""ImageToTextInferenceConfig and NeuronBaseForImageToText: NxDI's vision-language application contract
(models/image_to_text_model_base.py).

Their InferenceConfig takes a text and a vision NeuronConfig, not one, and nests the HF config's
``text_config`` / ``vision_config`` as InferenceConfigs of their own; a caller that builds these configs with a
single NeuronConfig fails here as on NxD (TypeError). The application's text forward takes
``vision_embeddings`` (1, seq_len, hidden) and ``vision_mask`` (1, bucket, 1) holding the prompt positions the
embedding rows go to (NxDI traces positions, not a boolean mask); context encoding puts the rows there
(``scatter_by_index_put``), token generation takes empty tensors. The families' forwards (qwen2_vl) compute
both from their image inputs. After construction ``config`` is the text config and ``full_config`` the whole
one, as in NxDI.
"""

from __future__ import annotations

import copy
import json
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast

from neuronx_distributed_inference.models.application_base import (
    COMPILE_LOG,
    COMPILED_MODEL_FILE_NAME,
    LOAD_LOG,
    normalize_path,
)
from neuronx_distributed_inference.models.config import CONFIG_FILE, InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM
from nxdserve.engine.models.runner import SlotModelRunner

SUBMODELS = ("text_model/", "vision_model/")


class ImageToTextInferenceConfig(InferenceConfig):
    def __init__(
        self,
        text_neuron_config: NeuronConfig,
        vision_neuron_config: NeuronConfig,
        fused_spec_config: Any = None,
        load_config: Any = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            neuron_config=copy.deepcopy(text_neuron_config),
            fused_spec_config=fused_spec_config,
            load_config=load_config,
            metadata=metadata,
            **kwargs,
        )
        assert hasattr(self, "text_config"), "Passed config doesn't contain text_config"
        assert hasattr(self, "vision_config"), "Passed config doesn't contain vision_config"
        text = self.text_config
        vision = self.vision_config
        self.text_config = InferenceConfig(text_neuron_config, **(vars(text) if isinstance(text, SimpleNamespace)
                                                                  else dict(text)))
        self.text_config._name_or_path = getattr(self, "_name_or_path", None)
        self.vision_config = InferenceConfig(
            vision_neuron_config, **(vars(vision) if isinstance(vision, SimpleNamespace) else dict(vision))
        )

    def validate_config(self) -> None:  # the nested configs are checked by the families
        return None

    @classmethod
    def load(cls, model_path: str | os.PathLike[str], **kwargs: Any) -> InferenceConfig:
        """NxDI's ``from_json_string``: both NeuronConfigs rebuilt from the nested configs' entries."""
        with open(os.path.join(model_path, CONFIG_FILE), encoding="utf-8") as f:
            merged = json.loads(f.read())
        merged.update(kwargs)
        text_nc = cls.get_neuron_config_cls()(**merged["text_config"].pop("neuron_config"))
        vision_nc = cls.get_neuron_config_cls()(**merged["vision_config"].pop("neuron_config"))
        merged.pop("neuron_config")
        return cls(text_nc, vision_nc, **merged)

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return NeuronConfig


class NeuronBaseForImageToText(NeuronBaseForCausalLM):
    """The text model runs as the causal-LM emulator's, with the vision rows written into the context
    encoding's input embeddings; the family supplies ``_load_vision`` (its encoder and rotary tables)."""

    def __init__(self, text_model_cls: Any, vision_model_cls: Any, text_model_wrapper: Any,
                 vision_model_wrapper: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.text_model_cls, self.vision_model_cls = text_model_cls, vision_model_cls
        self.text_config = self.config.text_config
        self.vision_config = self.config.vision_config
        self.vocab_size = self.text_config.vocab_size
        self.full_config = self.config  # NxDI switches config to the text config while it builds the text
        # models, then back to the full one
        self.vision_calls: list[dict[str, Any]] = []  # test probe: every vision-encoder call
        self._vision_inputs: tuple[torch.Tensor, torch.Tensor] | None = None  # this call's embeddings and mask

    # -- compile / load: NxDI traces two models, text_model/model.pt and vision_model/model.pt ---------------
    def compile(self, compiled_model_path: str, debug: bool = False, pre_shard_weights_hook: Any = None,
                dry_run: bool = False, disable_fail_fast: bool = False) -> None:
        compiled_model_path = normalize_path(compiled_model_path)
        self.config.save(compiled_model_path)
        if dry_run:
            return
        COMPILE_LOG.append(compiled_model_path)
        archive = {"emulated": True, "config": json.loads(self.config.to_json_string())}
        for sub in SUBMODELS:
            os.makedirs(compiled_model_path + sub, exist_ok=True)
            with open(compiled_model_path + sub + COMPILED_MODEL_FILE_NAME, "w", encoding="utf-8") as f:
                json.dump(archive, f)
        self.is_compiled = True

    def load(self, compiled_model_path: str, start_rank_id: int | None = None, local_ranks_size: int | None = None,
             skip_warmup: bool = False) -> None:
        compiled_model_path = normalize_path(compiled_model_path)
        for sub in SUBMODELS:
            archive_path = compiled_model_path + sub + COMPILED_MODEL_FILE_NAME
            if not os.path.isfile(archive_path):  # torch.jit.load's error for a missing file
                raise ValueError(f"The provided filename {archive_path} does not exist")
            with open(archive_path, encoding="utf-8") as f:
                if json.load(f)["config"] != json.loads(self.config.to_json_string()):
                    raise ValueError(f"{archive_path} was compiled for a different configuration")
        LOAD_LOG.append(compiled_model_path)
        self.load_weights(compiled_model_path)
        self.is_loaded_to_neuron = True
        if not self.neuron_config.skip_warmup and not skip_warmup:
            self.warmup()

    def _weights_path(self) -> str:
        return self.model_path if self.model_path else str(self.full_config._name_or_path)

    def forward(self, *args: Any, vision_embeddings: torch.Tensor | None = None,  # type: ignore[override]
                vision_mask: torch.Tensor | None = None, deepstack_vision_embeds: Any = None,
                rotary_position_ids: Any = None, **kwargs: Any) -> CausalLMOutputWithPast:
        if deepstack_vision_embeds is not None or (rotary_position_ids is not None and rotary_position_ids.numel()):
            raise NotImplementedError("emulator: deepstack embeddings and rotary_position_ids are not emulated")
        has_vision = vision_embeddings is not None and vision_mask is not None and vision_embeddings.numel() > 0
        self._vision_inputs = (vision_embeddings, vision_mask) if has_vision else None  # type: ignore[assignment]
        try:
            return NeuronBaseForCausalLM.forward(self, *args, **kwargs)
        finally:
            self._vision_inputs = None

    __call__ = forward

    # -- the text model with vision rows ------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _cte_forward(self, runner: SlotModelRunner, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     seq_ids: torch.Tensor) -> torch.Tensor:
        batch, bucket = input_ids.shape
        assert batch == 1, "image-to-text context encoding runs one sequence per call (ctx_batch_size=1)"
        line = int(seq_ids[0])
        ids = input_ids[0].long()
        embeds = F.embedding(ids, runner.model.embed_weight)
        if self._vision_inputs is not None:
            rows, where = self._vision_inputs
            where = where.reshape(-1).long()
            rows = rows.reshape(-1, rows.shape[-1])
            # scatter_by_index_put: row i goes to position where[i]. Only the image tokens' rows are written
            # here; NxDI's padded tail (zero rows at bucket - 1) is left out.
            n = int((ids == int(self.text_config.image_token_id)).sum())
            embeds[where[:n]] = rows[:n].to(embeds.dtype)
        hidden = runner.run(ids, np.array([line]), np.array([0]), np.array([bucket]), embeds=embeds,
                            cos_sin=self._rope(position_ids[0].long()))
        index = torch.max(position_ids[0], dim=0).indices
        return runner.logits(hidden[index].unsqueeze(0))

    def _traced_tkg(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    seq_ids: torch.Tensor, sampling_params: torch.Tensor) -> Any:
        assert self.target is not None
        rows = self._active_rows(seq_ids)
        positions = position_ids[:, 0].long()
        ids = input_ids[rows, 0].long()
        logits = torch.zeros(input_ids.shape[0], self.target.model.vocab_size)
        hidden = self.target.run(ids, rows, positions.numpy()[rows], np.ones(rows.size, dtype=np.int64),
                                 cos_sin=self._rope(positions[torch.from_numpy(rows)]))
        logits[torch.from_numpy(rows)] = self.target.logits(hidden)
        return self._outputs(logits, sampling_params)
