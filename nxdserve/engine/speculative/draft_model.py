"""Draft-model proposer: a small Llama-family model (or the target's first N layers) drafts greedily.

The draft runs through its own ``SlotModelRunner``: the same slots as the target, its own KV cache.
Per slot we track ``kv_len``, how many leading positions of the draft's cache hold KV for the
request's real tokens. Each drafting round for a request with N tokens and lookahead k:

1. catch up: run the real tokens ``[kv_len, N)`` (the whole prompt the first time, afterwards the
   1-2 tokens the target accepted since) - the logits at position N - 1 give draft 1;
2. chain: run draft j at position N + j - 1 to get draft j + 1, for j < k (batched over requests,
   rows drop out as their own k is reached).

Drafts 1..k-1 are written into the draft cache at positions N..N+k-2 - below max_model_len - 2
because k <= max_model_len - 1 - N. After the target verifies, ``sync`` compares those written
drafts with the tokens that really landed there (value by value, so it is right whatever the
verifier or a stop check did) and keeps the agreeing prefix; the rest is simply overwritten by the
next catch-up. A slot handed to a new request starts again from 0.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from nxdserve.engine.models import LlamaFamilyModel, SlotModelRunner
from nxdserve.engine.models.cpu_kernels import argmax
from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.speculative.base import DraftRows, SpeculativeProposer
from nxdserve.engine.speculative.config import SpeculativeConfig
from nxdserve.engine.step import StepResult
from nxdserve.scheduler.scheduler import SchedulerOutput


def truncated_model(target: LlamaFamilyModel, hf_config: Any, num_layers: int) -> LlamaFamilyModel:
    """The target's first ``num_layers`` decoder layers plus its final norm and LM head, sharing the
    target's tensors (no copy): the self-draft."""
    spec = dataclasses.replace(
        target.spec, num_layers=num_layers, sliding_windows=target.spec.sliding_windows[:num_layers]
    )
    config = copy.copy(hf_config)
    config.num_hidden_layers = num_layers
    # Built on the meta device so no memory is touched, then pointed at the target's tensors.
    draft = LlamaFamilyModel(spec, config, target.dtype, torch.device("meta"), max_len=target.max_len)
    draft.device = target.device
    draft.embed_weight = target.embed_weight
    draft.lm_head_weight = target.lm_head_weight
    draft.layers = nn.ModuleList(list(target.layers[:num_layers]))
    draft.norm = target.norm
    draft.rope = target.rope
    return draft.eval()


class DraftModelProposer(SpeculativeProposer):
    method = "draft_model"

    def __init__(
        self,
        spec: SpeculativeConfig,
        max_model_len: int,
        num_slots: int,
        draft: LlamaFamilyModel,
    ) -> None:
        super().__init__(spec, max_model_len)
        self.runner = SlotModelRunner(draft, num_slots, max_model_len)
        self.device = draft.device
        self.kv_len = np.zeros(num_slots, dtype=np.int64)
        # The drafts written into the cache by the last round (positions spec_from .. + num_written).
        self.written = np.full((num_slots, max(self.k - 1, 1)), -1, dtype=np.int64)
        self.num_written = np.zeros(num_slots, dtype=np.int64)
        self.spec_from = np.zeros(num_slots, dtype=np.int64)
        self.owners: list[str | None] = [None] * num_slots

    @classmethod
    def from_path(
        cls, spec: SpeculativeConfig, max_model_len: int, num_slots: int, path: str | Path,
        dtype: torch.dtype, device: torch.device,
    ) -> DraftModelProposer:
        draft = LlamaFamilyModel.from_pretrained(path, dtype, device, max_len=max_model_len)
        return cls(spec, max_model_len, num_slots, draft)

    # -- bookkeeping ---------------------------------------------------------------------------------
    def sync(self, batch: PersistentBatch, sched: SchedulerOutput, result: StepResult) -> None:
        new = self.reassigned_slots(self.owners, sched)
        self.kv_len[new] = 0
        self.num_written[new] = 0
        slots = np.flatnonzero(self.num_written > 0)
        if slots.size == 0:
            return
        # Keep the written drafts that match the tokens that really landed at their positions.
        width = self.written.shape[1]
        cols = np.arange(width)[None, :]
        pos = self.spec_from[slots, None] + cols
        landed = batch.token_ids[slots[:, None], np.minimum(pos, batch.token_ids.shape[1] - 1)]
        ok = (
            (cols < self.num_written[slots, None])
            & (pos < batch.num_tokens[slots, None])
            & (self.written[slots] == landed)
        )
        agree = np.cumprod(ok, axis=1).sum(axis=1)
        self.kv_len[slots] = self.spec_from[slots] + agree
        self.num_written[slots] = 0

    # -- drafting ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, rows: DraftRows, batch: PersistentBatch) -> tuple[np.ndarray, np.ndarray]:
        slots, n, k = rows.slots, rows.num_tokens, rows.k
        # Re-run at least the last real token: its logits give draft 1.
        starts = np.minimum(self.kv_len[slots], n - 1)
        lens = n - starts
        token_row = np.repeat(np.arange(slots.size), lens)
        offsets = np.zeros(slots.size + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        positions = starts[token_row] + np.arange(offsets[-1]) - offsets[token_row]
        tokens = torch.from_numpy(batch.token_ids[slots[token_row], positions])
        hidden = self.runner.run(tokens, slots, starts, lens)
        last = torch.from_numpy(offsets[1:] - 1).to(self.device)
        current = self._argmax(hidden.index_select(0, last))

        k_max = int(k.max())
        drafts = np.full((slots.size, k_max), -1, dtype=np.int64)
        drafts[:, 0] = current.cpu().numpy()
        active = np.arange(slots.size)
        for j in range(1, k_max):
            keep = k[active] > j
            active, current = active[keep], current[torch.from_numpy(np.flatnonzero(keep)).to(self.device)]
            if active.size == 0:
                break
            # Draft j (0-based j - 1) sits at position n + j - 1; its logits give the next one.
            hidden = self.runner.run(current, slots[active], n[active] + j - 1, np.ones(active.size, np.int64))
            current = self._argmax(hidden)
            drafts[active, j] = current.cpu().numpy()

        self.kv_len[slots] = n
        self.spec_from[slots] = n
        self.num_written[slots] = k - 1
        if k_max > 1:
            self.written[slots, : k_max - 1] = drafts[:, : k_max - 1]
        return drafts, k.copy()

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return argmax(self.runner.logits(hidden))
