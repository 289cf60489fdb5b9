"""Inputs for NxD's two calls, built from the persistent batch with numpy.

Context encoding (CTE): one prompt per call, ``input_ids``/``position_ids`` of shape (1, L) with
positions 0..L-1 and ``seq_ids = [slot]``; NxD pads to its bucket itself (right padding). The one
exception is a one-token prompt: NxD pads positions with 1 and reads the output at the first
``argmax(position_ids)``, which would be a pad. We then send the whole largest bucket ourselves with
pad positions 0, so NxD adds no padding and the maximum's first occurrence is the real token.

Token generation (TKG): one row per live slot, sorted by seq_id. With a batch equal to the compiled
batch NxD maps row i to KV line i and ignores seq_ids; with a smaller one it sorts itself, but pads
the batch with rows that write into the missing lines. Sorting here keeps both cases right; the
caller makes sure every live line is in the batch.

Sampling rows ``[top_k, top_p, temperature]`` are built per batch row (vllm-neuron fills them in
request-dict order, which mismatches rows when the batch order differs):
- temperature 0 -> [1, 1, 1]: NxD's greedy rule (top_k must be 1; temperature 1 avoids a division by 0);
- top_k <= 0 (disabled) or above global_topk -> global_topk: NxD reads 0/-1 as "uniform over the
  vocabulary" and rejects anything above global_topk; sampling happens within the global top-k anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nxdserve.sampling_params import GREEDY_EPS


@dataclass
class NxdCall:
    input_ids: torch.Tensor  # (B, S) int64; NxD casts to int32 itself
    position_ids: torch.Tensor  # (B, S) int64
    seq_ids: torch.Tensor  # (B,) int64, ascending
    sampling_params: torch.Tensor  # (B, 3) float32
    adapter_ids: torch.Tensor | None = None  # (B,) int32 LoRA indices (0: the base model), with lora_config
    # Qwen2-VL context encoding of a prompt with images (NeuronQwen2VLForCausalLM.forward): the processor's
    # patches (all images, patch features) and each image's (t, h, w) grid. NxD derives the image-token
    # positions (its vision_mask) from input_ids itself.
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def kwargs(self) -> dict[str, torch.Tensor | None]:
        # attention_mask=None: NxD infers it from position_ids, as both vllm-neuron versions rely on.
        kwargs = {
            "input_ids": self.input_ids,
            "attention_mask": None,
            "position_ids": self.position_ids,
            "seq_ids": self.seq_ids,
            "sampling_params": self.sampling_params,
        }
        if self.adapter_ids is not None:
            kwargs["adapter_ids"] = self.adapter_ids
        if self.pixel_values is not None:
            kwargs["pixel_values"] = self.pixel_values
            kwargs["image_grid_thw"] = self.image_grid_thw
        return kwargs


def sampling_rows(
    temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, global_topk: int | None
) -> torch.Tensor:
    """(B, 3) float32 rows in batch-row order. ``global_topk`` None (no on-device sampling): values
    are passed through, since NxD only validates them when it samples."""
    greedy = temperature < GREEDY_EPS
    k = top_k.astype(np.float32)
    if global_topk is not None:
        k = np.where((top_k <= 0) | (top_k > global_topk), np.float32(global_topk), k)
    rows = np.stack(
        [
            np.where(greedy, np.float32(1.0), k),
            np.where(greedy, np.float32(1.0), top_p.astype(np.float32)),
            np.where(greedy, np.float32(1.0), temperature.astype(np.float32)),
        ],
        axis=1,
    )
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))


def cte_call(prompt: np.ndarray, slot: int, params: torch.Tensor, largest_bucket: int, pad_token_id: int) -> NxdCall:
    """One prompt (L,) for KV line ``slot``; ``params`` is its (1, 3) sampling row."""
    n = int(prompt.shape[0])
    if n == 1 and largest_bucket > 1:
        input_ids = torch.full((1, largest_bucket), pad_token_id, dtype=torch.int64)
        input_ids[0, 0] = int(prompt[0])
        position_ids = torch.zeros((1, largest_bucket), dtype=torch.int64)
    else:
        input_ids = torch.from_numpy(prompt.astype(np.int64)).view(1, n)
        position_ids = torch.arange(n, dtype=torch.int64).view(1, n)
    return NxdCall(input_ids, position_ids, torch.tensor([slot], dtype=torch.int64), params)


def tkg_call(tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, params: torch.Tensor) -> NxdCall:
    """Rows already sorted by slot: one input token per live slot at its next position."""
    assert np.all(np.diff(slots) > 0), "token-generation rows must be sorted by seq_id"
    return NxdCall(
        torch.from_numpy(tokens.astype(np.int64)).view(-1, 1),
        torch.from_numpy(positions.astype(np.int64)).view(-1, 1),
        torch.from_numpy(slots.astype(np.int64)),
        params,
    )
