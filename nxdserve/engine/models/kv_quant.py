"""fp8 KV cache (``--kv-cache-dtype``): the storage format, its per-layer scales, and the write/read casts.

As vLLM: ``fp8`` is e4m3 (``fp8_e4m3``; torch.float8_e4m3fn, max 448, 3 mantissa bits), ``fp8_e5m2`` the wider
range with 2 mantissa bits. A cached value is ``fp8(x / scale)`` and reads back as ``fp8 * scale``, with one
scale for K and one for V per layer (vLLM's per-tensor ``k_scale``/``v_scale``). Scales are 1.0 unless
``--calculate-kv-scales`` sets them from the first forward that writes a layer (amax / 200 for K, amax / 100
for V, vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: headroom for later, larger values). Values past the
format's range saturate (clamped), never NaN/inf.
"""

from __future__ import annotations

import torch

from nxdserve.config import KV_CACHE_DTYPES
from nxdserve.errors import ConfigError

_STORAGE: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT: the first forward's amax maps to these with --calculate-kv-scales.
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}.")


def storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element dtype for a ``--kv-cache-dtype`` value (``auto``: the model's)."""
    check_kv_cache_dtype(name)
    return _STORAGE.get(name, model_dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


class KVScales:
    """Per-layer (k_scale, v_scale), as Python floats for the attention calls and as a (layers, 2) fp32
    tensor for whole-cache writes. ``calculate``: each layer's pair is set by the first forward that writes it."""

    def __init__(self, num_layers: int, calculate: bool = False) -> None:
        self.pairs: list[tuple[float, float]] = [(1.0, 1.0)] * num_layers
        self.pending = [calculate] * num_layers
        self.num_pending = num_layers if calculate else 0
        self._cpu: torch.Tensor | None = None

    def for_layer(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
        if self.pending[index]:
            amax_k = float(k.detach().abs().amax()) if k.numel() else 0.0
            amax_v = float(v.detach().abs().amax()) if v.numel() else 0.0
            # A layer whose first K/V are all zero keeps 1.0 (a zero scale would divide by zero).
            self.pairs[index] = (amax_k / K_SCALE_RANGE or 1.0, amax_v / V_SCALE_RANGE or 1.0)
            self.pending[index] = False
            self.num_pending -= 1
            self._cpu = None
        return self.pairs[index]

    def cpu_pairs(self) -> torch.Tensor:
        """The pairs as a contiguous (layers, 2) fp32 CPU tensor, made once per change (the fused forward's
        ``kv_scales``)."""
        if self._cpu is None:
            self._cpu = self.tensor(torch.device("cpu"))
        return self._cpu

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.pairs, dtype=torch.float32, device=device)


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``fp8(x / scale)``, saturating at the format's largest finite value."""
    limit = torch.finfo(dtype).max
    y = x.float() if scale == 1.0 else x.float() / scale  # x itself for fp32 at scale 1: clamp out of place
    return y.clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in ``dtype`` (the attention's). A copy: the fallback reads of the torch path."""
    y = x.to(dtype)
    return y if scale == 1.0 else y.mul_(scale)
