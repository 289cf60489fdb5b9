"""Reading NxD outputs: on-device tokens, logits, and fused-speculation results.

- on-device sampling: ``.tokens`` int32 (B,) (vllm-neuron reads the same tensor as ``.hidden_states``);
- no on-device sampling: ``.logits`` float32 (B, 1, V), the last real position only;
- on-device sampling with ``output_logits``: both;
- fused speculation: ``.fused_outputs = [accepted (B, k) int32 padded with -1, next_input_ids (B, 1),
  next_attention_mask (B, S), next_pos_ids (B, 1), ...]``. The accepted count is
  ``next_pos_ids - position_ids[:, -1]`` (vllm-neuron's rule; after context encoding it is 1), and
  everything past it is treated as padding whatever its value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

FUSED_ACCEPTED, FUSED_NEXT_POS = 0, 3  # indices into fused_outputs


def read_tokens(output: Any) -> np.ndarray:
    tokens = getattr(output, "tokens", None)
    if tokens is None:
        tokens = output.hidden_states
    return tokens.reshape(-1).to(torch.int64).numpy()


def read_logits(output: Any, vocab_size: int) -> torch.Tensor:
    """(B, V) float32 logits of the last position, trimmed of the lm_head's vocabulary padding."""
    logits = output.logits
    if logits is None:
        raise RuntimeError("NxD returned no logits: on-device sampling is on and output_logits is off")
    return logits[:, -1, :vocab_size].float()


def read_fused(output: Any, rows: np.ndarray, last_positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (n, k) int64 padded with -1, counts (n,) in 1..k) for batch ``rows`` of a
    fused-speculation output; ``last_positions`` are those rows' input positions."""
    fused = output.fused_outputs
    accepted = fused[FUSED_ACCEPTED].to(torch.int64).numpy()[rows]
    next_pos = fused[FUSED_NEXT_POS].reshape(-1).to(torch.int64).numpy()[rows]
    return fused_tokens(accepted, next_pos, last_positions)


def fused_tokens(
    accepted: np.ndarray, next_pos: np.ndarray, last_positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    width = accepted.shape[1]
    counts = np.clip(next_pos - last_positions, 1, width)
    keep = np.arange(width)[None, :] < counts[:, None]
    tokens = np.where(keep, accepted, -1)
    if np.any(tokens[keep] < 0):
        raise RuntimeError(f"NxD fused speculation returned padding inside the accepted tokens: {accepted.tolist()}")
    return tokens, counts
