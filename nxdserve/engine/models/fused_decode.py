"""bf16 forward through the fused C decoder (``csrc/decode.c``): one call for all layers.

``FusedDecode.accepts`` decides per forward; anything it does not cover (fp32, more than ``MAX_TOKENS``
tokens, q/k norms, activations other than SiLU, autograd, a step with a LoRA adapter row, draft alternatives on
an fp8 KV cache or one whose calculated scales are not set yet) takes the layer-by-layer path. An fp8 KV cache
(``--kv-cache-dtype``) it writes as codes and reads widened to bf16, exactly: in registers in the decode items,
through a thread's scratch one (slot, KV head) line at a time elsewhere (docs/kv-cache.md). The C forward has no
LoRA shrink/expand: steps whose rows all run the base model keep it, and a step with any adapter row runs the
torch layers (whose fused elementwise kernels and packed GEMMs still apply) plus the grouped LoRA GEMMs of
``nxdserve/lora/stack.py``.
Measured on a 2-core AVX512-BF16 EPYC (SmolLM2-135M): see ``benchmarks/perf_notes.md``.
``CpuOptions.fused_decode`` turns it off (A/B measurements).
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nxdserve.engine.models import cpu_kernels, gemm, module_swaps, quant
from nxdserve.engine.models.attention import AttentionMetadata, SlotKVCache
from nxdserve.engine.models.quant import QuantLinear

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from nxdserve.engine.models.llama import DecoderLayer, RMSNorm
    from nxdserve.engine.models.rope import RotaryTables
    from nxdserve.engine.models.spec import ModelSpec

# Since attention goes by blocks of tokens (``decode.c``), the fused forward beats the layer path at
# every size measured: 0.78x its time for a 128-token chunk at position 0, 0.75x for 256, 0.76x for 512, and
# 0.60x for 256 or 512 tokens after 900-1000 (SDPA's attention). The cap bounds its scratch (T x ~13 KB on
# SmolLM2-135M); longer forwards take the layer path.
MAX_TOKENS = 2048

enabled = True  # set from CpuOptions (cpu_setup.apply)


@functools.cache
def silu_table() -> torch.Tensor:
    """torch's bf16 silu of every bf16 value, by bit pattern (65536 entries and a pad for the C gather): the
    fused forward looks its activation up here, so it has the eager layer's bits by construction."""
    every_value = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return torch.cat((F.silu(every_value).view(torch.int16), torch.zeros(1, dtype=torch.int16)))


_Sources = tuple["torch.Tensor | QuantLinear | None", ...]
_PACKED = (1, 3, 6, 8)  # the weight matrices among a layer's ``_Sources``; norms and biases stay as they are


class _LayerTable:
    """The C pointer table of a stack against one KV cache, and the layers' windows. It holds every tensor it points
    into but the cache (whose address and shape are in its key), so no pointer in it can outlive its memory."""

    def __init__(self, key: tuple[object, ...], pointers: list[int | None], windows: list[int], held: list[object]):
        self.key = key
        self.pointers = (ctypes.c_void_p * len(pointers))(*pointers)
        self.windows = (ctypes.c_int64 * len(windows))(*windows)
        self.held = held


def _dense_bf16(weight: torch.Tensor | QuantLinear) -> bool:
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"


def _dense(weight: torch.Tensor | QuantLinear) -> torch.Tensor:
    """A weight as the fused forward reads it: a quantized one's dense bf16 copy (see ``accepts``)."""
    return weight.dense_copy(torch.bfloat16) if isinstance(weight, QuantLinear) else weight


def available() -> bool:
    return enabled and cpu_kernels.available() and cpu_kernels.built("decode_forward_available")


class FusedDecode:
    """The fused forward bound to a stack of decoder layers: their weight pointers, built once per KV cache.

    ``run`` takes the stack's input states: a model's embeddings (its stack has a final norm), or an EAGLE
    head's fc output (its one layer has none, and the layer's output is returned as it is)."""

    def __init__(
        self,
        spec: ModelSpec,
        layers: Sequence[DecoderLayer],
        rope: RotaryTables,
        final_norm: RMSNorm | None = None,
    ) -> None:
        self.spec = spec
        self.layers = layers
        self.rope = rope
        self.final_norm = final_norm
        # One eps for every norm of the stack (Llama-family configs have one rms_norm_eps).
        self.eps = final_norm.eps if final_norm is not None else layers[0].post_norm.eps
        self.supported_model = (
            not spec.qk_norm
            and spec.hidden_act in ("silu", "swish")
            and spec.head_dim % 2 == 0  # RoPE rotates halves
            and spec.head_dim <= cpu_kernels.MAX_HEAD_DIM
            and spec.num_heads // spec.num_kv_heads <= cpu_kernels.MAX_GROUP
        )
        self._table: _LayerTable | None = None
        # The objects the table reads, per layer (``_layer_sources``), looked up again only after a decoder module's
        # attribute was assigned (module_swaps): their ids, windows, and the dense weights whose versions a step
        # compares (an in-place write rebuilds their packed copies, gemm.kept).
        self._swaps_seen = -1
        self._sources: list[_Sources] = []
        self._sources_key: tuple[object, ...] = ()
        self._versioned: tuple[torch.Tensor, ...] = ()
        self._buffers: list[torch.Tensor | None] = [None, None]
        # A bf16 model with quantized linears: its steps of more than this many tokens read the dense copies
        # (None: ``quant.dense_rows``, the layers' own switch). Set from a measurement at warm-up
        # (``quant_steps.py``): 0 where the dense copies beat the codes at every step size.
        self.quantized_dense_above: int | None = None

    def accepts(self, inputs: torch.Tensor, meta: AttentionMetadata, kv_cache: SlotKVCache) -> bool:
        """``inputs``: the token ids (``forward``) or input states (``run``) of this forward."""
        weight = self.layers[0].qkv_weight  # the live dtype: a module may be cast after it was built
        tokens = meta.num_tokens + (0 if meta.alts is None else meta.alts.count)
        return (
            self.supported_model
            and (_dense_bf16(weight) or self._quantized_step_reads_dense(weight, tokens))
            and 0 < tokens <= MAX_TOKENS
            # The C code trusts its indices: rows outside this cache take the checked torch path.
            and meta.max_slot < kv_cache.num_slots
            and meta.max_end <= kv_cache.max_len
            and (meta.alts is None or meta.alts.inside(kv_cache))
            # An fp8 cache: the C forward writes and reads its codes once every layer's scales are set (the layer
            # path's first forward sets calculated ones).
            and (not kv_cache.quantized or kv_cache.scales_set)
            and meta.use_kernel
            # The C forward has no LoRA: a step with an adapter row takes the layer-by-layer path.
            and meta.lora is None
            and not torch.is_grad_enabled()
            and available()
        )

    def _quantized_step_reads_dense(self, weight: torch.Tensor | QuantLinear, tokens: int) -> bool:
        """A bf16 model with quantized linears, in a step of more than ``quant.dense_rows`` tokens: each of its
        linear calls would multiply by the weight's dense bf16 copy (``QuantLinear.dense_copy``), so the fused forward
        reads those copies and the step runs in one call, as a dense bf16 model's (on AMX, 32 concurrent decode
        rows went from 0.35-0.39x the dense model's tok/s to 0.87-0.92x; the layer path keeps the same copies).
        ``quantized_dense_above`` moves that bound where warm-up measured the copies faster."""
        above = quant.dense_rows if self.quantized_dense_above is None else self.quantized_dense_above
        return (
            isinstance(weight, QuantLinear)
            and weight.fusable
            and bool(quant.dense_rows)
            and tokens > above
            and self.layers[0].post_norm.weight.dtype == torch.bfloat16
            and self.layers[0].post_norm.weight.device.type == "cpu"
        )

    def _layer_sources(self, layer: DecoderLayer) -> _Sources:
        """What a layer's table entry reads, in the C forward's order: norms and biases as they are, the weight
        matrices (``_PACKED``) as dense tensors or QuantLinears (whose dense copies it reads)."""
        return (
            getattr(layer.input_norm, "weight", None),  # an EAGLE head may have none (Identity)
            layer.qkv_weight,
            layer.qkv_bias,
            layer.o_weight,
            layer.o_bias,
            layer.post_norm.weight,
            layer.gate_up_weight,
            layer.gate_up_bias,
            layer.down_weight,
            layer.down_bias,
        )

    def _table_key(self, kv_cache: SlotKVCache) -> tuple[object, ...]:
        """Equal only while every pointer of the table is still right: the same cache layout, the same objects in
        the layers (held by the table, so their ids cannot be reused), the same windows, the dense weights not
        written since (their version counters: ~60 ns each, ~7 us a step for SmolLM2's 120), the same compression."""
        swaps = module_swaps.generation()
        if swaps != self._swaps_seen:
            self._sources = [self._layer_sources(layer) for layer in self.layers]
            windows = tuple(layer.window or 0 for layer in self.layers)
            self._sources_key = (tuple(id(o) for parts in self._sources for o in parts), windows)
            self._versioned = tuple(
                w for parts in self._sources for j in _PACKED if isinstance(w := parts[j], torch.Tensor)
            )
            self._swaps_seen = swaps
        versions = tuple(w._version for w in self._versioned)
        return (kv_cache.layout, self._sources_key, versions, gemm.compression)

    def _layer_table(self, kv_cache: SlotKVCache) -> _LayerTable:
        key = self._table_key(kv_cache)
        if self._table is None or self._table.key != key:
            pointers: list[int | None] = []
            windows: list[int] = []
            held: list[object] = []
            for i, (layer, sources) in enumerate(zip(self.layers, self._sources, strict=True)):
                k_cache, v_cache = kv_cache.layer(i)
                params = [None if p is None else _dense(p) for p in sources]  # norms and biases are tensors already
                for j, p in enumerate(params):
                    assert p is None or (p.is_contiguous() and p.dtype == torch.bfloat16)
                    read = None if p is None else gemm.pack(p) if j in _PACKED else p
                    pointers.append(None if read is None else read.data_ptr())
                    held.append(read)
                pointers += [k_cache.data_ptr(), v_cache.data_ptr()]
                for j in _PACKED:  # their compressed copies, where the tiles read them
                    weight = params[j]
                    blob = None if weight is None else gemm.compressed(weight)
                    pointers.append(None if blob is None else blob.data_ptr())
                    held.append(blob)
                windows.append(layer.window or 0)
            held += [o for parts in self._sources for o in parts]
            self._table = _LayerTable(key, pointers, windows, held)
        return self._table

    def _buffer(self, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Scratch kept between forwards and grown on demand: a fresh multi-megabyte allocation per step is
        a fresh mapping, and its page faults cost ~2% of a step."""
        buf = self._buffers[index]
        if buf is None or buf.numel() < numel:
            buf = self._buffers[index] = torch.empty(max(numel, 2 * (0 if buf is None else buf.numel())), dtype=dtype)
        return buf

    def run(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: SlotKVCache,
        keep: torch.Tensor | None = None,
        on_compute: Callable[[], None] | None = None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x (T, hidden), contiguous, overwritten -> the stack's output (final-normed where it has a norm).
        ``cos_sin``: each token's rotary rows (T, 1, head_dim) instead of the table's at its position (M-RoPE).

        ``keep``: increasing token indices (no alternatives); then only those rows are returned, and the last
        layer's attention, o, MLP and norm run for them alone (its q/k/v still run for all: the cache needs
        every token's K/V). A prompt chunk's tokens before its last are sampled by nobody: at SmolLM2's shapes
        that skips ~84% of a layer, 1/30 of the forward, for each of them. ``on_compute`` is called just before
        the C call (which runs without the GIL)."""
        s = self.spec
        lib = cpu_kernels._library()
        assert lib is not None and x.is_contiguous()
        layer_table = self._layer_table(kv_cache)
        table, windows = layer_table.pointers, layer_table.windows
        alts = meta.alts
        num_alts = 0 if alts is None else alts.count
        t = meta.num_tokens + num_alts
        positions, write_slots = meta.positions, meta.write_slots
        alt_kv = 0
        if alts is not None:  # they follow the rows' tokens in x (see DraftAlternatives)
            assert alts.kv is not None and alts.kv.dtype == torch.bfloat16 and alts.kv.is_contiguous()
            positions = torch.cat((positions, alts.positions))
            write_slots = torch.cat((write_slots, alts.slots))
            alt_kv = alts.kv.data_ptr()
        assert x.shape[0] == t
        kept = None
        if keep is not None:
            if alts is not None:
                raise ValueError("keep cannot be combined with draft alternatives")
            kept = keep.to(torch.int64).contiguous()
            if kept.numel() and not (int(kept[0]) >= 0 and int(kept[-1]) < t and bool((kept[1:] > kept[:-1]).all())):
                raise ValueError("keep must hold increasing token indices of this forward")
        if cos_sin is None:
            cos = self.rope.cos.index_select(0, positions)
            sin = self.rope.sin.index_select(0, positions)
        else:
            cos, sin = (table.reshape(t, -1).to(torch.bfloat16).contiguous() for table in cos_sin)
        threads = torch.get_num_threads()
        qkv = s.q_size + 2 * s.kv_size
        # + 24 per token: the attention block, alternative group and token kind tables (6 int64 per token) after
        # the activations
        work = self._buffer(0, t * (s.hidden_size + qkv + s.q_size + 3 * s.intermediate_size + 24), torch.bfloat16)
        kv_fp8 = kv_cache.fp8_format
        scales = kv_cache.scales.cpu_pairs() if kv_cache.scales is not None else None
        per_thread = lib.decode_forward_scratch(s.num_heads // s.num_kv_heads, meta.max_end, s.head_dim, kv_fp8)
        scratch = self._buffer(1, threads * per_thread, torch.float32)
        k_cache, _ = kv_cache.layer(0)
        final_norm = None if self.final_norm is None else self.final_norm.weight.data_ptr()
        if on_compute is not None:
            on_compute()
        args = cpu_kernels.DecodeArgs(
            x.data_ptr(), t, ctypes.addressof(table), ctypes.addressof(windows), len(self.layers), final_norm,
            cos.data_ptr(), sin.data_ptr(), write_slots.data_ptr(), positions.data_ptr(),
            s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size,
            k_cache.stride(0), k_cache.stride(1), work.data_ptr(), scratch.data_ptr(), num_alts, alt_kv or None,
            silu_table().data_ptr(), None if kept is None else kept.data_ptr(), -1 if kept is None else kept.numel(),
            None if scales is None else scales.data_ptr(), self.eps, threads, kv_fp8,
        )  # fmt: skip
        lib.decode_forward_bf16(ctypes.byref(args))
        return x if kept is None else x[: kept.numel()]
