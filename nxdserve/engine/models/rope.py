"""Rotary position embeddings as cos/sin tables indexed by absolute position.

Inverse frequencies come from the config: the plain formula for "default", and transformers'
``ROPE_INIT_FUNCTIONS`` (the field's reference for linear, dynamic, llama3 and yarn scaling) for the
rest. Tables cover every position a slot can hold, so a forward only gathers rows by position.

"dynamic" NTK scaling changes the frequencies only past ``max_position_embeddings``; the engine never
serves longer sequences (``max_model_len`` is capped there), so its init-time frequencies are exact.
"""

from __future__ import annotations

from typing import Any

import torch

from nxdserve.errors import ConfigError


def rope_inv_freq(config: Any, head_dim: int, rope_type: str) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim // 2,) float32, attention scaling applied to cos and sin)."""
    if rope_type == "default":
        params = getattr(config, "rope_parameters", None) or {}
        base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv_freq, scaling = 1.0 / (base**exponents), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    inv_freq = inv_freq.to(torch.float32)
    if inv_freq.numel() * 2 != head_dim:
        raise ConfigError("Partial rotary embeddings are not supported by the torch backend.")
    return inv_freq, float(scaling)


class RotaryTables:
    """cos/sin of shape (max_len, head_dim) in the model dtype, in the rotate-half layout of HF checkpoints."""

    def __init__(
        self, inv_freq: torch.Tensor, scaling: float, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        # float32 angles, then cast: the same arithmetic as the reference, so fp32 runs match exactly.
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = (angles.cos() * scaling).to(dtype=dtype, device=device)
        self.sin = (angles.sin() * scaling).to(dtype=dtype, device=device)

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at ``positions`` (T,), shaped (T, 1, head_dim) to broadcast over heads; once per forward."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (T, heads, head_dim) with tables from ``RotaryTables.gather``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
