"""fp32 forward of a quantized decoder stack through one C call (``csrc/qdecode.c``) for a few rows.

A model served from its 4/8-bit codes (``quant.QuantLinear``: GGUF blocks, ``--quantization``, compressed-tensors)
runs a small step's linears in ``csrc/qgemm.c``; layer by layer that is ~4 ctypes calls and OpenMP team wake-ups
per layer with Python's norms, RoPE, attention and SiLU in between. ``FusedQuantDecode`` runs all layers in one
parallel region instead, the same arithmetic (fp32 activations and KV cache, codes widened in registers). An fp8
KV cache (``--kv-cache-dtype``) it writes as torch casts and reads with the layer path's fp8 attention items.

``accepts`` decides per forward; everything else takes the layer path: more tokens than ``max_rows()`` (more than
``max_decode_rows()`` for a step of one token per row), a bf16 model, an fp8 KV cache whose calculated scales are not
set yet, draft alternatives, a LoRA
adapter row, q/k norms, activations other than SiLU, any linear that is not a kernel-format QuantLinear (mixed
dense/quantized stacks, q8_0 groups that are not multiples of 32, padded K), autograd, no C kernels
(``--cpu-isa none``). ``CpuOptions.fused_quant_decode`` turns it off (A/B measurements).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from nxdserve.engine.models import cpu_kernels, module_swaps, quant
from nxdserve.engine.models.attention import AttentionMetadata, SlotKVCache
from nxdserve.engine.models.quant import QuantLinear

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from nxdserve.engine.models.llama import DecoderLayer, RMSNorm
    from nxdserve.engine.models.rope import RotaryTables
    from nxdserve.engine.models.spec import ModelSpec

enabled = True  # set from CpuOptions.fused_quant_decode (cpu_setup.apply)
# The most rows with quant.dense_rows at 0 (QuantLinears on the kernel at every size) on a build without the paired
# rows: the forward keeps T rows' scratch per thread and its row tiles are sized for decode.
MAX_ROWS_UNBOUNDED = 16
_LINEARS = ("qkv", "o", "gate_up", "down")
_CACHE_DTYPES = (torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)
_WEIGHT_AND_BIAS_ATTRS = tuple(f"{name}_{part}" for name in _LINEARS for part in ("weight", "bias"))


def max_rows() -> int:
    """The most tokens a fused step takes: as many as the QuantLinears run on their codes in fp32 (``dense_rows``,
    and up to ``quant.KERNEL_ROWS`` where the build has the paired rows, which the forward uses from 9 rows on AVX2,
    12 elsewhere)."""
    rows = quant.dense_rows or MAX_ROWS_UNBOUNDED
    return max(rows, quant.KERNEL_ROWS) if cpu_kernels.built("qgemm_paired_available") else rows


def max_decode_rows() -> int:
    """The most rows a fused step of one token per row (plain decode) takes: up to the paired rows' limit
    (``quant.kernel_rows()``, 64 in the AVX2 build). A prompt chunk of as many tokens does not: the forward attends
    its tokens one by one, which at long contexts lost to the layer path's batched attention (64 tokens at position
    1900: 1.09x the time; 48 decode rows at position 1024: 0.73x the widened copy's, perf_notes.md)."""
    return max(max_rows(), quant.kernel_rows())


def _one_token_rows(meta: AttentionMetadata) -> bool:
    return not meta.chunks and meta.batched is not None and meta.batched.num_queries == 1


class _LayerTable:
    """The C pointer table of a stack against one KV cache (ctypes arrays). Its key, the cache's layout and the
    ids of the objects in the layers, is checked against the live objects before each use; it holds those objects
    (a QuantLinear keeps its codes, never written in place), so no id in the key can be reused while it lives."""

    def __init__(
        self, key: tuple[object, ...], pointers: list[int | None], formats: list[int], windows: list[int], held: object
    ):
        self.key = key
        self.pointers = (ctypes.c_void_p * len(pointers))(*pointers)
        self.formats = (ctypes.c_int32 * len(formats))(*formats)
        self.windows = (ctypes.c_int64 * len(windows))(*windows)
        self.held = held


class FusedQuantDecode:
    """The fused quantized forward bound to a model's decoder layers and final norm."""

    def __init__(self, spec: ModelSpec, layers: Sequence[DecoderLayer], rope: RotaryTables, final_norm: RMSNorm):
        self.spec = spec
        self.layers = layers
        self.rope = rope
        self.final_norm = final_norm
        self.eps = final_norm.eps  # Llama-family configs have one rms_norm_eps for every norm
        self.supported_model = (
            not spec.qk_norm
            and spec.hidden_act in ("silu", "swish")
            and spec.head_dim % 2 == 0  # RoPE rotates halves
            and spec.head_dim <= cpu_kernels.MAX_HEAD_DIM
            and spec.num_heads // spec.num_kv_heads <= cpu_kernels.MAX_GROUP
        )
        self._table: _LayerTable | None = None
        self._weights_key: tuple[object, ...] | None = None
        self._weights_held: list[object] = []  # the objects whose ids are in _weights_key
        self._weights_ok = False
        self._swaps_seen = -1  # module_swaps.generation() when the layers were last looked at

    def _linears(self, layer: DecoderLayer) -> tuple[object, ...]:
        return (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)

    def _stack_key(self) -> tuple[object, ...]:
        """The ids of the objects in place (``_weights_held`` keeps them, so that no id can be reused while it
        counts) and the layers' windows: quantize_linears swaps the linears, and a QuantLinear's codes never change
        in place. Read from the modules' own dicts: through ``nn.Module.__getattr__`` (~1 us a name) this took
        ~250 us a call for SmolLM2's 30 layers; still ~0.14 ms a step cold, so it runs only after a swap
        (``_weights_supported``). The layers themselves are the model's for good (bound at construction)."""
        held: list[object] = []
        windows: list[int] = []
        for layer in self.layers:
            attrs, params, modules = layer.__dict__, layer._parameters, layer._modules
            held += [params[name] if name in params else attrs[name] for name in _WEIGHT_AND_BIAS_ATTRS]
            for norm in ("input_norm", "post_norm"):
                module = modules[norm]
                assert module is not None
                held.append(module._parameters["weight"])
            windows.append(layer.window or 0)
        self._weights_held = held
        return (tuple(id(o) for o in held), tuple(windows))

    def _weights_supported(self) -> bool:
        """Every linear a QuantLinear in a kernel format with K a multiple of 32 (no padding), norms fp32. The
        layers are looked at again only after an attribute of a decoder module was assigned (module_swaps)."""
        swaps = module_swaps.generation()
        if swaps != self._swaps_seen:
            key = self._stack_key()
            if key != self._weights_key:
                self._weights_key, self._weights_ok = key, all(self._layer_supported(layer) for layer in self.layers)
            self._swaps_seen = swaps
        return self._weights_ok

    def _layer_supported(self, layer: DecoderLayer) -> bool:
        from nxdserve.engine.models.llama import RMSNorm

        if type(layer.input_norm) is not RMSNorm or type(layer.post_norm) is not RMSNorm:
            return False
        if layer.input_norm.weight.dtype != torch.float32 or layer.post_norm.weight.dtype != torch.float32:
            return False
        s = self.spec
        shapes = (
            (s.q_size + 2 * s.kv_size, s.hidden_size),
            (s.hidden_size, s.q_size),
            (2 * s.intermediate_size, s.hidden_size),
            (s.hidden_size, s.intermediate_size),
        )
        biases = (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias)
        for weight, bias, shape in zip(self._linears(layer), biases, shapes, strict=True):
            if not isinstance(weight, QuantLinear) or weight.data.device.type != "cpu" or tuple(weight.shape) != shape:
                return False
            kernel = weight._kernel_args()
            if kernel is None or kernel.in_features != weight.in_features:
                return False
            if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
                return False
        return True

    def accepts(self, token_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: SlotKVCache) -> bool:
        return (
            enabled
            and self.supported_model
            and meta.num_tokens > 0
            and meta.num_tokens + (0 if meta.alts is None else meta.alts.count)
            <= (max_decode_rows() if _one_token_rows(meta) and meta.alts is None else max_rows())
            and meta.lora is None
            and meta.use_kernel
            and kv_cache.dtype == torch.float32  # an fp32 model's cache: fp32, or fp8 codes once its scales are set
            and kv_cache.data.dtype in _CACHE_DTYPES
            and kv_cache.scales_set
            and kv_cache.data.device.type == "cpu"
            # The C code trusts its indices: rows outside this cache take the checked torch path.
            and meta.max_slot < kv_cache.num_slots
            and meta.max_end <= kv_cache.max_len
            and (meta.alts is None or meta.alts.inside(kv_cache))
            and self.final_norm.weight.dtype == torch.float32
            and not torch.is_grad_enabled()
            and cpu_kernels.available()
            and self._weights_supported()
        )

    def _layer_table(self, kv_cache: SlotKVCache) -> _LayerTable:
        # The weights' key as accepts() (which every run follows, in the same forward) last checked it.
        assert self._weights_key is not None and self._weights_ok, "run() without accepts()"
        key = (kv_cache.layout, *self._weights_key)
        if self._table is None or self._table.key != key:
            pointers: list[int | None] = []
            formats: list[int] = []
            windows: list[int] = []

            def ptr(t: torch.Tensor | None) -> int | None:
                return None if t is None else t.data_ptr()

            for i, layer in enumerate(self.layers):
                biases = (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias)
                parts: list[int | None] = [layer.input_norm.weight.data_ptr()]
                for name, weight, bias in zip(_LINEARS, self._linears(layer), biases, strict=True):
                    assert isinstance(weight, QuantLinear), name
                    kernel = weight._kernel_args()
                    codes, scale, offset = kernel.tensors
                    parts += [ptr(codes), ptr(scale), ptr(offset), ptr(bias)]
                    formats.append(int(kernel.args.format))
                    if name == "o":
                        parts.append(layer.post_norm.weight.data_ptr())
                k_cache, v_cache = kv_cache.layer(i)
                parts += [k_cache.data_ptr(), v_cache.data_ptr()]
                assert len(parts) == cpu_kernels.QDECODE_LAYER_POINTERS
                pointers += parts
                windows.append(layer.window or 0)
            self._table = _LayerTable(key, pointers, formats, windows, self._weights_held)
        return self._table

    def run(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: SlotKVCache,
        keep: torch.Tensor | None = None,
        on_compute: Callable[[], None] | None = None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x (T, hidden) fp32 input states, overwritten -> the final-normed output, rows ``keep`` only where given.
        ``meta.alts``' tokens follow the rows' in x; their K/V go to ``alts.kv`` (fp32), not the cache.
        ``cos_sin``: each token's rotary rows instead of the table's at its position (M-RoPE)."""
        s = self.spec
        lib = cpu_kernels._library()
        assert lib is not None
        x = x.to(torch.float32).contiguous()
        alts = meta.alts
        num_alts = 0 if alts is None else alts.count
        t = meta.num_tokens + num_alts
        assert x.shape == (t, s.hidden_size)
        positions, slots, alt_kv = meta.positions, meta.write_slots, None
        if alts is not None:
            if keep is not None:
                raise ValueError("keep cannot be combined with draft alternatives")
            assert alts.kv is not None and alts.kv.dtype == torch.float32 and alts.kv.is_contiguous()
            positions = torch.cat((positions, alts.positions))
            slots = torch.cat((slots, alts.slots))
            alt_kv = alts.kv.data_ptr()
        table = self._layer_table(kv_cache)
        if cos_sin is None:
            cos = self.rope.cos.index_select(0, positions)
            sin = self.rope.sin.index_select(0, positions)
        else:
            cos, sin = (c.reshape(t, -1).to(torch.float32).contiguous() for c in cos_sin)
        positions = positions.contiguous()
        slots = slots.contiguous()
        k_cache, _ = kv_cache.layer(0)
        if on_compute is not None:
            on_compute()
        scales = kv_cache.scales.cpu_pairs() if kv_cache.scales is not None else None
        args = cpu_kernels.QdecodeArgs(
            x.data_ptr(), t, ctypes.addressof(table.pointers), ctypes.addressof(table.formats),
            ctypes.addressof(table.windows), len(self.layers), self.final_norm.weight.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), positions.data_ptr(),
            s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size,
            k_cache.stride(0), k_cache.stride(1), None if scales is None else scales.data_ptr(), alt_kv, num_alts,
            self.eps, torch.get_num_threads(), int(quant.int8_activations), kv_cache.fp8_format,
        )  # fmt: skip
        lib.qdecode_forward_f32(ctypes.byref(args))
        return x if keep is None else x[keep.to(torch.int64)]
