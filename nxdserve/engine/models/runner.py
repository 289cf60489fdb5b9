"""SlotModelRunner: a model plus its own slot KV cache, runnable on (slot, start, length) rows.

The torch backend runs the target model through one of these; a draft-model proposer makes a second
one for its draft model (same slots, its own cache), so the two never share attention state.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from nxdserve.engine.models import kv_quant
from nxdserve.engine.models.attention import (
    DEFAULT_BATCHED_QUERY_LIMIT,
    AttentionMetadata,
    DraftAlternatives,
    SlotKVCache,
)
from nxdserve.engine.models.llama import LlamaFamilyModel

if TYPE_CHECKING:
    from nxdserve.engine.models.quant import LinearMaker
    from nxdserve.lora.stack import LoraStep


class SlotModelRunner:
    def __init__(
        self,
        model: LlamaFamilyModel,
        num_slots: int,
        max_len: int,
        *,
        batched_query_limit: int = DEFAULT_BATCHED_QUERY_LIMIT,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
    ) -> None:
        """``kv_cache_dtype``: ``--kv-cache-dtype`` (auto | fp8 | fp8_e4m3 | fp8_e5m2; see ``kv_quant``)."""
        if max_len > model.max_len:
            raise ValueError(f"max_len={max_len} exceeds the model's RoPE table ({model.max_len}).")
        self.model = model
        self.num_slots = num_slots
        self.max_len = max_len
        self.batched_query_limit = batched_query_limit
        storage = kv_quant.storage_dtype(kv_cache_dtype, model.dtype)
        self.kv_cache: SlotKVCache = model.new_kv_cache(num_slots, max_len, storage, calculate_kv_scales)
        self.device = model.device
        spec = model.spec
        self._num_query_groups = spec.num_heads // spec.num_kv_heads

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
        quantize_linear: LinearMaker | None = None,
    ) -> SlotModelRunner:
        """``quantize_linear``: each decoder linear quantized as it loads (``LlamaFamilyModel.load_weights``)."""
        model = LlamaFamilyModel.from_pretrained(path, dtype, device, max_len=max_len, quantize_linear=quantize_linear)
        return cls(model, num_slots, max_len, kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales)

    def metadata(
        self,
        row_slots: np.ndarray,
        row_starts: np.ndarray,
        row_lens: np.ndarray,
        batched_query_limit: int | None = None,
    ) -> AttentionMetadata:
        return AttentionMetadata.build(
            row_slots,
            row_starts,
            row_lens,
            num_query_groups=self._num_query_groups,
            windows=self.model.windows,
            max_len=self.max_len,
            device=self.device,
            dtype=self.model.dtype,
            batched_query_limit=batched_query_limit or self.batched_query_limit,
        )

    def run(
        self,
        token_ids: torch.Tensor,
        row_slots: np.ndarray,
        row_starts: np.ndarray,
        row_lens: np.ndarray,
        batched_query_limit: int | None = None,
        alts: DraftAlternatives | None = None,
        keep: torch.Tensor | None = None,
        on_compute: Callable[[], None] | None = None,
        lora: LoraStep | None = None,
        embeds: torch.Tensor | None = None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run rows r = ``row_lens[r]`` tokens of slot ``row_slots[r]`` from position ``row_starts[r]``.

        ``token_ids`` (T,) is the rows' tokens concatenated in row order, then ``alts``' tokens if given.
        The rows' K/V are written into the slots' cache lines (the alternatives' go to ``alts.kv``);
        returns final-norm hidden states (T, hidden) in the model dtype; with ``keep`` (increasing token
        indices, no alternatives) those tokens' only, (len(keep), hidden). ``on_compute`` is called once the
        inputs are set up, as the model's compute (which releases the GIL) begins. ``embeds`` and ``cos_sin``
        replace the token embeddings and rotary tables (vision-language models: ``Qwen2VLModel.step_inputs``).
        """
        meta = self.metadata(row_slots, row_starts, row_lens, batched_query_limit)
        meta.lora = lora  # every token's adapter, the rows' then the alternatives' (LoraStack.step)
        if alts is not None:
            if not alts.inside(self.kv_cache):
                raise ValueError("a draft alternative lies outside the KV cache")
            meta.alts = alts
        expected = meta.num_tokens + (0 if alts is None else alts.count)
        if token_ids.shape[0] != expected:
            raise ValueError(f"{token_ids.shape[0]} token ids for rows and alternatives totalling {expected} tokens")
        return self.model(token_ids.to(self.device), meta, self.kv_cache, keep, on_compute, embeds, cos_sin)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits (..., vocab) for hidden states (..., hidden)."""
        return self.model.compute_logits(hidden)

    def greedy_tokens(self, hidden: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """(N,) argmax of ``logits(hidden)[:, :vocab]`` without the logits, or None where that shortcut does
        not apply (the caller then takes the logits)."""
        return self.model.compute_greedy(hidden, vocab)
