"""Per-row sampling parameters gathered from the persistent batch, once per call.

A "row" is one logits row: a slot for ``sample``, a (slot, draft position) pair for ``verify``.
Everything here is host-side numpy, so the sampler decides which stages to run without touching
the device (no syncs on an accelerator).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.sampling_params import GREEDY_EPS


@dataclass
class RowParams:
    slots: np.ndarray  # (R,) int64 slot of each row
    src: np.ndarray  # (R,) int64 the caller's row this logits row belongs to (verify: batch row)
    extra: np.ndarray  # (R,) int64 draft tokens that precede this position (0 for sample)
    temperature: np.ndarray  # (R,) float32, 0 = greedy
    top_p: np.ndarray
    top_k: np.ndarray
    min_p: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray
    num_logprobs: np.ndarray
    min_tokens: np.ndarray
    num_tokens: np.ndarray  # (R,) prompt + output tokens of the slot, drafts excluded
    num_prompt_tokens: np.ndarray

    @classmethod
    def gather(
        cls,
        batch: PersistentBatch,
        slots: np.ndarray,
        extra: np.ndarray | None = None,
        src: np.ndarray | None = None,
    ) -> RowParams:
        slots = np.asarray(slots, dtype=np.int64)
        n = slots.shape[0]
        return cls(
            slots=slots,
            src=np.arange(n, dtype=np.int64) if src is None else src,
            extra=np.zeros(n, dtype=np.int64) if extra is None else extra,
            temperature=batch.temperature[slots],
            top_p=batch.top_p[slots],
            top_k=batch.top_k[slots].astype(np.int64),
            min_p=batch.min_p[slots],
            presence_penalty=batch.presence_penalty[slots],
            frequency_penalty=batch.frequency_penalty[slots],
            repetition_penalty=batch.repetition_penalty[slots],
            num_logprobs=batch.num_logprobs[slots],
            min_tokens=batch.min_tokens[slots].astype(np.int64),
            num_tokens=batch.num_tokens[slots].astype(np.int64),
            num_prompt_tokens=batch.num_prompt_tokens[slots].astype(np.int64),
        )

    @property
    def num_rows(self) -> int:
        return int(self.slots.shape[0])

    @property
    def greedy(self) -> np.ndarray:
        return self.temperature < GREEDY_EPS

    @property
    def num_output_tokens(self) -> np.ndarray:
        """Outputs that precede this row's position (drafts before it count as outputs)."""
        return self.num_tokens - self.num_prompt_tokens + self.extra

    @property
    def needs_penalties(self) -> np.ndarray:
        return (self.presence_penalty != 0.0) | (self.frequency_penalty != 0.0) | (self.repetition_penalty != 1.0)


def _csr(lists: list[np.ndarray], dtype: type) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((a.shape[0] for a in lists), dtype=np.int64, count=len(lists))
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values: np.ndarray = np.concatenate(lists).astype(dtype) if lists else np.zeros(0, dtype=dtype)
    return offsets, values


def csr_take(offsets: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For CSR lists selected by ``keys``: (index into ``keys`` of each entry, flat index of each entry)."""
    starts = offsets[keys]
    lengths = offsets[keys + 1] - starts
    total = int(lengths.sum())
    owner = np.repeat(np.arange(keys.shape[0], dtype=np.int64), lengths)
    first = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return owner, first + np.arange(total, dtype=np.int64)


class SlotTables:
    """The batch's ragged per-slot fields (logit bias, min-tokens stop ids, seeds) as flat arrays.

    Built once per batch composition (``PersistentBatch.version``), so a step gathers them with
    numpy indexing instead of walking Python dicts and lists row by row.
    """

    def __init__(self, batch: PersistentBatch) -> None:
        self._batch = weakref.ref(batch)  # not id(): a new batch may reuse a freed one's id
        self.version = batch.version
        empty_i = np.zeros(0, dtype=np.int64)
        empty_f = np.zeros(0, dtype=np.float32)
        bias_ids: list[np.ndarray] = []
        bias_vals: list[np.ndarray] = []
        for bias in batch.logit_bias:
            if bias:
                bias_ids.append(np.fromiter((int(k) for k in bias), dtype=np.int64, count=len(bias)))
                bias_vals.append(np.fromiter(bias.values(), dtype=np.float32, count=len(bias)))
            else:
                bias_ids.append(empty_i)
                bias_vals.append(empty_f)
        self.bias_offsets, self.bias_ids = _csr(bias_ids, np.int64)
        _, self.bias_values = _csr(bias_vals, np.float32)
        stop = [np.asarray(ids, dtype=np.int64) for ids in batch.min_tokens_stop_ids]
        self.stop_offsets, self.stop_ids = _csr(stop, np.int64)
        self.seeded = np.fromiter((g is not None for g in batch.generators), dtype=bool)

    def matches(self, batch: PersistentBatch) -> bool:
        return self._batch() is batch and self.version == batch.version

    def has_bias(self, slots: np.ndarray) -> np.ndarray:
        return self.bias_offsets[slots + 1] > self.bias_offsets[slots]

    def has_stop_ids(self, slots: np.ndarray) -> np.ndarray:
        return self.stop_offsets[slots + 1] > self.stop_offsets[slots]


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> tensor on ``device``. On CPU this shares memory: never write into the result."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)
