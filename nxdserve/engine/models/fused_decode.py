"""Small-batch bf16 forward through the fused C decoder (``decode_source``): one call for all layers.

``FusedDecode.accepts`` decides per forward; anything it does not cover (fp32, long prefill chunks,
more than ``MAX_TOKENS`` tokens, q/k norms, activations other than SiLU, autograd) takes the layer-by-
layer path. Measured on a 2-core AVX512-BF16 EPYC (SmolLM2-135M): see ``benchmarks/perf_notes.md``.
``NXDSERVE_FUSED_DECODE=0`` turns it off (A/B measurements).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nxdserve.engine.models import cpu_kernels
from nxdserve.engine.models.attention import AttentionMetadata, SlotKVCache

if TYPE_CHECKING:
    from nxdserve.engine.models.llama import LlamaFamilyModel

# Measured forward times, SmolLM2-135M, 2 threads, fused vs layer by layer (oneDNN prepacked GEMMs):
# 1 token 5.8-9.3 vs 17-24 ms, 4: 8.9-9.7 vs 17-18, 8: 18.5 vs 21.7, 12: 28.9 vs 25.1 (oneDNN's blocked
# GEMMs win once the weights are reused across enough tokens).
MAX_TOKENS = 8
_TILED_ATTR = "_nxdserve_tiled"

enabled = os.environ.get("NXDSERVE_FUSED_DECODE", "1") != "0"


def tile_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (N, K) in the kernel's tiled layout (see ``decode_source``): (ceil(N/4), ceil(K/32), 4, 32),
    zero-padded. Made once and kept on the weight tensor (keyed by its version counter, like the oneDNN
    packed copy in ``linear``), so modules sharing a weight share the copy. It costs one more copy of
    each weight matrix in memory, the price of full memory bandwidth at small batch."""
    entry = getattr(weight, _TILED_ATTR, None)
    if entry is not None and entry[0] == weight._version:
        return entry[1]
    n, k = weight.shape
    n_pad, k_pad = -n % 4, -k % 32
    with torch.inference_mode():
        padded = F.pad(weight.detach(), (0, k_pad, 0, n_pad))
        tiled = padded.view((n + n_pad) // 4, 4, (k + k_pad) // 32, 32).transpose(1, 2).contiguous()
    setattr(weight, _TILED_ATTR, (weight._version, tiled))
    return tiled


@functools.cache
def _built() -> bool:
    """Whether the kernel library has the fused forward (AVX512-BF16 targets only); asked once."""
    lib = cpu_kernels._library()
    return lib is not None and bool(lib.decode_forward_available())


def available() -> bool:
    return enabled and cpu_kernels.available() and _built()


class FusedDecode:
    """The fused forward bound to one model: its weight pointers, built once per KV cache."""

    def __init__(self, model: LlamaFamilyModel) -> None:
        self.model = model
        s = model.spec
        self.supported_model = (
            model.dtype == torch.bfloat16
            and model.device.type == "cpu"
            and not s.qk_norm
            and s.hidden_act in ("silu", "swish")
            and s.head_dim % 4 == 0  # whole heads per thread start at a tiled block
            and s.intermediate_size % 4 == 0
            and s.head_dim <= cpu_kernels.MAX_HEAD_DIM
            and s.num_heads // s.num_kv_heads <= cpu_kernels.MAX_GROUP
        )
        self._table: tuple[tuple[int, int], ctypes.Array[ctypes.c_void_p], ctypes.Array[ctypes.c_int64]] | None = None

    def accepts(self, token_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: SlotKVCache) -> bool:
        return (
            self.supported_model
            and 0 < meta.num_tokens <= MAX_TOKENS
            # The C code trusts its indices: rows outside this cache take the checked torch path.
            and meta.max_slot < kv_cache.num_slots
            and meta.max_end <= kv_cache.max_len
            and meta.use_kernel
            and not meta.chunks
            and meta.kernel_select is None
            and meta.kernel_count == meta.num_tokens
            and not torch.is_grad_enabled()
            and available()
        )

    def _layer_table(self, kv_cache: SlotKVCache) -> tuple[ctypes.Array[ctypes.c_void_p], ctypes.Array[ctypes.c_int64]]:
        # Rebuilt for another cache, or when the weights were written again (loading bumps every version).
        key = (kv_cache.data.data_ptr(), self.model.layers[0].qkv_weight._version)
        if self._table is None or self._table[0] != key:
            pointers: list[int | None] = []
            windows: list[int] = []
            for i, layer in enumerate(self.model.layers):
                k_cache, v_cache = kv_cache.layer(i)
                params = (layer.input_norm.weight, layer.qkv_weight, layer.qkv_bias, layer.o_weight, layer.o_bias,
                          layer.post_norm.weight, layer.gate_up_weight, layer.gate_up_bias, layer.down_weight,
                          layer.down_bias)
                tiled = {1, 3, 6, 8}  # the weight matrices; norms and biases stay as they are
                for j, p in enumerate(params):
                    assert p is None or (p.is_contiguous() and p.dtype == torch.bfloat16)
                    pointers.append(None if p is None else (tile_weight(p) if j in tiled else p).data_ptr())
                pointers += [k_cache.data_ptr(), v_cache.data_ptr()]
                windows.append(layer.window or 0)
            table = (ctypes.c_void_p * len(pointers))(*pointers)
            window_array = (ctypes.c_int64 * len(windows))(*windows)
            self._table = (key, table, window_array)
        return self._table[1], self._table[2]

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: SlotKVCache) -> torch.Tensor:
        """token_ids (T,) -> final-norm hidden states (T, hidden), like ``LlamaFamilyModel.forward``."""
        model, s = self.model, self.model.spec
        lib = cpu_kernels._library()
        assert lib is not None
        table, windows = self._layer_table(kv_cache)
        t = meta.num_tokens
        x = F.embedding(token_ids, model.embed_weight).contiguous()
        cos = model.rope.cos.index_select(0, meta.positions)
        sin = model.rope.sin.index_select(0, meta.positions)
        threads = torch.get_num_threads()
        qkv = s.q_size + 2 * s.kv_size
        work = torch.empty(t * (qkv + s.q_size + s.intermediate_size) + threads * t * s.hidden_size,
                           dtype=torch.bfloat16)
        max_ctx = meta.max_end
        group = s.num_heads // s.num_kv_heads
        scratch = torch.empty(t * (qkv + 2 * s.intermediate_size + s.hidden_size) + threads * group * max_ctx,
                              dtype=torch.float32)
        k_cache, _ = kv_cache.layer(0)
        lib.decode_forward_bf16(
            x.data_ptr(), t, table, windows, len(model.layers), model.norm.weight.data_ptr(), model.norm.eps,
            cos.data_ptr(), sin.data_ptr(), meta.write_slots.data_ptr(), meta.positions.data_ptr(),
            s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size,
            k_cache.stride(0), k_cache.stride(1), work.data_ptr(), scratch.data_ptr(), threads,
        )  # fmt: skip
        return x


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear`` for at most ``MAX_TOKENS`` bf16 rows through ``linear_small_bf16``; None where it does
    not apply. Measured for the LM head of SmolLM2 (49152 x 576) at one row, 2 threads: see perf_notes."""
    if (
        x.dim() != 2
        or not 0 < x.shape[0] <= MAX_TOKENS
        or x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or weight.dim() != 2
        or not weight.is_contiguous()
        or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()))
        or not available()
    ):
        return None
    lib = cpu_kernels._library()
    assert lib is not None
    x = x.contiguous()
    rows, (n, k) = x.shape[0], weight.shape
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    scratch = torch.empty(rows * n, dtype=torch.float32)
    bias_ptr = None if bias is None else bias.data_ptr()
    lib.linear_small_bf16(x.data_ptr(), rows, tile_weight(weight).data_ptr(), bias_ptr, n, k, out.data_ptr(),
                          scratch.data_ptr(), torch.get_num_threads())
    return out
