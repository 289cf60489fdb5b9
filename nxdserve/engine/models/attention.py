"""Slot KV cache and attention for one flattened batch that mixes decode rows and prefill chunks.

A slot is one cache line of ``max_len`` positions (an NxD ``seq_id``). A forward runs rows; row r is
``row_lens[r]`` consecutive tokens of slot ``row_slots[r]`` starting at position ``row_starts[r]``:
a decode (1 token), a speculative verification (1 + k tokens) or a prefill chunk starting anywhere.
Each new token attends to its slot's cached positions before it and causally within its row.

Attention runs as few SDPA calls as possible:
- rows with at most ``batched_query_limit`` tokens (decodes, verifications, small chunks) form one
  batched call over their cache lines, padded to the longest of them and masked by length;
- each longer prefill chunk gets its own call over its own line (a view, no copy).

GQA without repeating K/V: the query heads that share one KV head are folded into the query-length
axis, so SDPA sees (rows, kv_heads, group * queries, head_dim) against (rows, kv_heads, ctx, head_dim).
Measured on this CPU, that beats both ``enable_gqa=True`` (slow in bf16) and repeat_interleave.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from nxdserve.engine.models import cpu_kernels, huge_pages, kv_quant
from nxdserve.engine.models.kv_quant import KVScales

if TYPE_CHECKING:
    from nxdserve.lora.stack import LoraStep

DEFAULT_BATCHED_QUERY_LIMIT = 8
# Rows of one token each (all decodes) skip the general build's token-row expansion (AttentionMetadata._decode_rows);
# False takes the general path for them too (tests compare the two).
decode_rows_shortcut = True


class SlotKVCache:
    """K and V for every layer, slot and position: one zero-filled tensor
    (layers, 2, slots, kv_heads, max_len, head_dim). Zero, not empty: masked positions still enter
    SDPA's matmuls and must be finite. On CPU it is in transparent huge pages where the OS allows
    (``huge_pages``): decodes touch it in thousands of scattered runs a step.

    ``storage``: an fp8 dtype stores ``fp8(x / scale)`` with ``scales`` per layer (``kv_quant``); attention
    quantizes on write; decodes read the codes in the C kernel (``cpu_kernels.slot_attention_fp8``), the SDPA
    paths (prefill chunks, no kernel) widen what they read. None: the model's ``dtype``, as written."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        storage: torch.dtype | None = None,
        calculate_scales: bool = False,
    ) -> None:
        self.num_slots = num_slots
        self.max_len = max_len
        self.dtype = dtype  # what attention computes in
        storage = storage or dtype
        self.quantized = kv_quant.is_fp8(storage)
        if storage != dtype and not self.quantized:
            raise ValueError(f"a KV cache stores the model dtype or fp8, not {storage}")
        self.scales: KVScales | None = KVScales(num_layers, calculate_scales) if self.quantized else None
        shape = (num_layers, 2, num_slots, num_kv_heads, max_len, head_dim)
        self.data = torch.empty(shape, dtype=storage, device=device)
        huge_pages.advise(self.data)  # before the zero fill faults the pages in
        self.data.zero_()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer, each (slots, kv_heads, max_len, head_dim); views into the cache."""
        return self.data[index, 0], self.data[index, 1]

    @property
    def fp8_format(self) -> int:
        """The fused C forwards' ``kv_fp8``: 0 a cache in the model dtype, 1 e4m3fn codes, 2 e5m2 codes."""
        if not self.quantized:
            return 0
        return 2 if self.data.dtype == torch.float8_e5m2 else 1

    @property
    def scales_set(self) -> bool:
        """Whether every layer's fp8 scales are set (calculated ones by the first forward that writes the layer);
        True for a cache in the model dtype."""
        return self.scales is None or not self.scales.num_pending

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def layout(self) -> tuple[int, tuple[int, ...], torch.dtype]:
        """Where the cache lies, its shape and element type: what a table of per-layer pointers into it depends
        on. The address alone is not enough: a freed cache's address comes back for the next one, whose layers may
        start elsewhere (a table keyed on it wrote K/V past a shorter cache's end: heap corruption, seen as aborts
        in malloc); an fp8 cache of the same shape has its layers at half a bf16 one's offsets."""
        return self.data.data_ptr(), tuple(self.data.shape), self.data.dtype


@dataclass
class _BatchedRows:
    """Rows attended together in one SDPA call, padded to ``num_queries`` tokens each."""

    num_rows: int
    num_queries: int
    ctx_len: int
    slot_start: int | None  # rows are slots slot_start.. consecutively: the cache is sliced, not gathered
    slots: torch.Tensor  # (B,)
    # Flat token index of each (row, query) pair, pads repeating the row's last token; None when the
    # group is the whole batch in order with one query per row (plain decode: no gather needed).
    query_index: torch.Tensor | None
    # Which padded (row, query) pairs are real, and which flat token each one is.
    valid_index: torch.Tensor | None  # None: all pairs are real
    token_index: torch.Tensor | None  # None together with query_index
    query_pos: torch.Tensor  # (B, Q) position of each padded query
    num_query_groups: int
    dtype: torch.dtype | None
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> (B, 1, G*Q, ctx), additive or bool

    def mask(self, window: int | None) -> torch.Tensor:
        """The SDPA mask for ``window``, built on first use (the CPU kernel needs none)."""
        m = self.masks.get(window)
        if m is None:
            allowed = _allowed(self.query_pos, self.ctx_len, self.query_pos.device)  # (B, Q, ctx)
            m = _restrict(allowed, self.query_pos, window).unsqueeze(1)  # (B, 1, Q, ctx)
            if self.num_queries > 1:  # folded layout (B, 1, G*Q, ctx): group-major, then query
                m = m.unsqueeze(2).expand(-1, -1, self.num_query_groups, -1, -1)
                m = m.reshape(self.num_rows, 1, -1, self.ctx_len)
            m = self.masks[window] = _additive(m, self.dtype)  # one query: (B, 1, 1, ctx) broadcasts over G
        return m


@dataclass
class _Chunk:
    """One long prefill chunk, attended alone."""

    slot: int
    token_start: int  # offset in the flat batch
    num_tokens: int
    ctx_len: int  # start position + num_tokens
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> (G*n, ctx), additive or bool


@dataclass
class DraftAlternatives:
    """Tokens run after a forward's rows as alternatives to some rows' first draft (tree verification of
    width > 1 at the first draft position). Alternative a stands at ``positions[a]`` (its row's first draft
    position) of slot ``slots[a]`` and attends that slot's keys before it plus itself: never the row's
    own draft there, nor the other alternatives. Its K/V never stay in the cache; the forward leaves them
    in ``kv`` (layers, A, 2, kv_heads, head_dim) so that an accepted alternative's can be installed."""

    slots: torch.Tensor  # (A,) int64, grouped by row
    positions: torch.Tensor  # (A,) int64
    kv: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return int(self.slots.shape[0])

    def inside(self, kv_cache: SlotKVCache) -> bool:
        """Whether every alternative's (slot, position) lies in ``kv_cache`` (the fused C forwards trust them)."""
        if self.count == 0:
            return True
        slots, positions = self.slots, self.positions
        return 0 <= int(slots.min()) <= int(slots.max()) < kv_cache.num_slots and (
            0 <= int(positions.min()) <= int(positions.max()) < kv_cache.max_len
        )

    def install(self, kv_cache: SlotKVCache, index: int) -> None:
        """Write alternative ``index``'s K/V (every layer) at its position: it was accepted."""
        assert self.kv is not None
        slot, pos = int(self.slots[index]), int(self.positions[index])
        kv = self.kv[:, index]  # (layers, 2, kv_heads, head_dim)
        if kv_cache.scales is not None:  # fp8: each layer's K and V by its own scale
            limit = torch.finfo(kv_cache.data.dtype).max
            scales = kv_cache.scales.tensor(kv.device)[:, :, None, None]
            kv = (kv.float() / scales).clamp_(-limit, limit).to(kv_cache.data.dtype)
        kv_cache.data[:, :, slot, :, pos, :] = kv


@dataclass
class AttentionMetadata:
    """Everything attention needs about one forward, built once and shared by all layers."""

    num_tokens: int
    positions: torch.Tensor  # (T,) absolute position of each token in its slot
    write_slots: torch.Tensor  # (T,) slot of each token (where its K/V go)
    batched: _BatchedRows | None
    chunks: list[_Chunk]
    # CPU kernel (cpu_kernels.slot_attention): it writes every token's K/V and attends the batched rows'
    # tokens in place (``kernel_select``, None when they are the first ``kernel_count``); chunks use SDPA.
    use_kernel: bool = False
    kernel_select: torch.Tensor | None = None
    kernel_count: int = 0
    max_slot: int = 0  # bounds the kernel checks against the cache it is given
    max_end: int = 0
    # Extra tokens after the rows' ``num_tokens`` (see DraftAlternatives); the forward runs both.
    alts: DraftAlternatives | None = None
    # The step's LoRA adapters (nxdserve.lora.stack.LoraStep); None when no token runs an adapter.
    lora: LoraStep | None = None
    # An fp8 KV cache's per-layer scales (set by the model's forward from its cache); None: not quantized.
    kv_scales: KVScales | None = None

    @classmethod
    def build(
        cls,
        row_slots: np.ndarray,
        row_starts: np.ndarray,
        row_lens: np.ndarray,
        *,
        num_query_groups: int,
        windows: frozenset[int | None],
        max_len: int,
        device: torch.device,
        dtype: torch.dtype | None = None,
        batched_query_limit: int = DEFAULT_BATCHED_QUERY_LIMIT,
        attention_kernel: bool | None = None,
    ) -> AttentionMetadata:
        """Rows as in the module docstring. With ``dtype`` (the model's), masks are built additive in it
        once here; without, they stay boolean and SDPA converts them in every layer.

        ``attention_kernel``: run the batched rows through the CPU kernel (``cpu_kernels``); None picks
        it on CPU when it is available and ``dtype`` is one it runs (bf16, fp32 or unknown)."""
        slots = np.asarray(row_slots, dtype=np.int64)
        starts = np.asarray(row_starts, dtype=np.int64)
        lens = np.asarray(row_lens, dtype=np.int64)
        if lens.size == 0 or lens.min() < 1:
            raise ValueError("every row must run at least one token")
        if int((starts + lens).max()) > max_len:
            raise ValueError(f"a row runs past the cache line length {max_len}")
        if np.unique(slots).size != slots.size:
            raise ValueError("a slot appears in more than one row")

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        if attention_kernel is None:
            attention_kernel = (
                device.type == "cpu" and dtype in (None, torch.bfloat16, torch.float32) and cpu_kernels.available()
            )
        if decode_rows_shortcut and int(lens.max()) == 1 and batched_query_limit >= 1:
            return cls._decode_rows(slots, starts, num_query_groups, windows, dtype, to_dev, bool(attention_kernel))

        offsets = np.zeros(lens.size + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        num_tokens = int(offsets[-1])
        token_row = np.repeat(np.arange(lens.size), lens)
        positions = starts[token_row] + np.arange(num_tokens) - offsets[token_row]
        is_batched = lens <= batched_query_limit
        batched = None
        if is_batched.any():
            batched = _build_batched(
                slots[is_batched],
                starts[is_batched],
                lens[is_batched],
                offsets[:-1][is_batched],
                whole_batch=bool(is_batched.all()),
                num_query_groups=num_query_groups,
                windows=windows,
                dtype=dtype,
                to_dev=to_dev,
                lazy_masks=bool(attention_kernel),
            )
        chunks = []
        for r in np.flatnonzero(~is_batched):
            start, n = int(starts[r]), int(lens[r])
            query_pos = torch.arange(start, start + n, device=device)
            allowed = _allowed(query_pos, start + n, device)  # (n, ctx)
            # Folded layout (G*n, ctx): group-major, then query.
            masks = {w: _additive(_restrict(allowed, query_pos, w).repeat(num_query_groups, 1), dtype) for w in windows}
            chunks.append(_Chunk(int(slots[r]), int(offsets[r]), n, start + n, masks))
        kernel_select, kernel_count = None, 0
        if attention_kernel:
            batched_tokens = np.flatnonzero(is_batched[token_row])
            kernel_count = int(batched_tokens.size)
            if kernel_count and batched_tokens[-1] != kernel_count - 1:  # not simply the first tokens
                kernel_select = to_dev(batched_tokens)
        return cls(
            num_tokens,
            to_dev(positions),
            to_dev(slots[token_row]),
            batched,
            chunks,
            use_kernel=bool(attention_kernel),
            kernel_select=kernel_select,
            kernel_count=kernel_count,
            max_slot=int(slots.max()),
            max_end=int((starts + lens).max()),
        )

    @classmethod
    def _decode_rows(
        cls,
        slots: np.ndarray,
        starts: np.ndarray,
        num_query_groups: int,
        windows: frozenset[int | None],
        dtype: torch.dtype | None,
        to_dev: Callable[[np.ndarray], torch.Tensor],
        attention_kernel: bool,
    ) -> AttentionMetadata:
        """What ``build`` makes of rows of one token each (every row a decode), without the token-row expansion
        (part of the torch backend's lean decode path: ``TorchBackend._execute_decode``)."""
        positions = to_dev(starts)
        slots_dev = to_dev(slots)
        max_end = int(starts.max()) + 1
        batched = _BatchedRows(
            num_rows=int(slots.size),
            num_queries=1,
            ctx_len=max_end,
            slot_start=int(slots[0]) if bool(np.all(np.diff(slots) == 1)) else None,
            slots=slots_dev,
            query_index=None,
            valid_index=None,
            token_index=None,
            query_pos=positions.view(-1, 1),
            num_query_groups=num_query_groups,
            dtype=dtype,
        )
        if not attention_kernel:
            for w in windows:
                batched.mask(w)
        return cls(
            int(slots.size),
            positions,
            slots_dev,
            batched,
            [],
            use_kernel=attention_kernel,
            kernel_count=int(slots.size) if attention_kernel else 0,
            max_slot=int(slots.max()),
            max_end=max_end,
        )


def _allowed(query_pos: torch.Tensor, ctx_len: int, device: torch.device) -> torch.Tensor:
    """Causal over the whole line: key k is visible to a query at position p when k <= p."""
    keys = torch.arange(ctx_len, device=device)
    return keys <= query_pos[..., None]


def _restrict(allowed: torch.Tensor, query_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Sliding window: additionally p - k < window."""
    if window is None:
        return allowed
    keys = torch.arange(allowed.shape[-1], device=allowed.device)
    return allowed & (keys > query_pos[..., None] - window)


def _additive(allowed: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """0 where allowed, -inf elsewhere. SDPA turns a bool mask into this on every call; building it once
    per forward saves that conversion in every layer (measured: ~4% of a CPU decode step)."""
    if dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _build_batched(
    slots: np.ndarray,
    starts: np.ndarray,
    lens: np.ndarray,
    token_offsets: np.ndarray,
    *,
    whole_batch: bool,
    num_query_groups: int,
    windows: frozenset[int | None],
    dtype: torch.dtype | None,
    to_dev: Callable[[np.ndarray], torch.Tensor],
    lazy_masks: bool,
) -> _BatchedRows:
    num_rows = int(slots.size)
    num_queries = int(lens.max())
    ctx_len = int((starts + lens).max())
    # Pads repeat the row's last query, so every padded query has a valid (non-empty) mask row.
    q_offset = np.minimum(np.arange(num_queries)[None, :], lens[:, None] - 1)  # (B, Q)
    query_pos = to_dev(starts[:, None] + q_offset)
    contiguous = bool(np.all(np.diff(slots) == 1))
    if whole_batch and num_queries == 1:
        query_index = valid_index = token_index = None  # plain decode: q is already in row order
    else:
        query_index = to_dev((token_offsets[:, None] + q_offset).reshape(-1))
        valid = (np.arange(num_queries)[None, :] < lens[:, None]).reshape(-1)
        valid_index = None if valid.all() else to_dev(np.flatnonzero(valid))
        token_index = to_dev((token_offsets[:, None] + q_offset).reshape(-1)[valid])
    rows = _BatchedRows(
        num_rows=num_rows,
        num_queries=num_queries,
        ctx_len=ctx_len,
        slot_start=int(slots[0]) if contiguous else None,
        slots=to_dev(slots),
        query_index=query_index,
        valid_index=valid_index,
        token_index=token_index,
        query_pos=query_pos,
        num_query_groups=num_query_groups,
        dtype=dtype,
    )
    if not lazy_masks:
        for w in windows:
            rows.mask(w)
    return rows


def slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    kv_scales: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Store the new K/V in their slots, then attend. q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq * D).

    An fp8 cache (``kv_quant``) stores ``fp8(k / k_scale)`` and ``fp8(v / v_scale)`` (``kv_scales``, 1.0 when
    None) and attends what it stores: the batched rows through the fp8 C kernel where it runs, else SDPA over
    widened copies."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    groups = num_heads // num_kv_heads
    if kv_quant.is_fp8(k_cache.dtype):
        k_scale, v_scale = kv_scales or (1.0, 1.0)
        k = kv_quant.quantize(k, k_scale, k_cache.dtype)
        v = kv_quant.quantize(v, v_scale, v_cache.dtype)
        reader = _Reader(q.dtype, k_scale, v_scale, head_dim)
        if (
            meta.use_kernel
            and meta.max_slot < k_cache.shape[0]
            and meta.max_end <= k_cache.shape[2]
            and cpu_kernels.supports_fp8(q, k_cache)
        ):
            # torch casts the codes (the same on every path); the kernel stores them and reads a byte per element,
            # with no widened copy (and no index_put: measured ~20 ms a layer on an fp8 tensor at 32 rows).
            out = q.new_empty(num_tokens, num_heads * head_dim)
            cpu_kernels.slot_attention_fp8(
                q, k, v, k_cache, v_cache, meta.write_slots, meta.positions, meta.kernel_select, meta.kernel_count,
                window, k_scale, v_scale, out,
            )  # fmt: skip
            _attend_chunks(q, k_cache, v_cache, meta, window, out, reader)
            return out
    elif (
        meta.use_kernel
        and meta.max_slot < k_cache.shape[0]
        and meta.max_end <= k_cache.shape[2]
        and cpu_kernels.supports(q, k_cache)
    ):
        out = q.new_empty(num_tokens, num_heads * head_dim)
        cpu_kernels.slot_attention(
            q, k, v, k_cache, v_cache, meta.write_slots, meta.positions, meta.kernel_select, meta.kernel_count,
            window, out,
        )  # fmt: skip
        _attend_chunks(q, k_cache, v_cache, meta, window, out)
        return out
    else:
        reader = _PLAIN

    k_cache[meta.write_slots, :, meta.positions] = k
    v_cache[meta.write_slots, :, meta.positions] = v
    b = meta.batched
    if b is not None and b.query_index is None:  # plain decode over the whole batch
        return _attend_batched(q, k_cache, v_cache, b, window, num_kv_heads, groups, reader)

    out = q.new_empty(num_tokens, num_heads * head_dim)
    if b is not None:
        assert b.token_index is not None and b.query_index is not None
        qb = q.index_select(0, b.query_index)
        o = _attend_batched(qb, k_cache, v_cache, b, window, num_kv_heads, groups, reader)
        if b.valid_index is not None:
            o = o.index_select(0, b.valid_index)
        out.index_copy_(0, b.token_index, o)
    _attend_chunks(q, k_cache, v_cache, meta, window, out, reader)
    return out


@dataclass(frozen=True)
class _Reader:
    """How attention reads cached K/V: as stored (model dtype), or widened from fp8 with the K scale folded
    into SDPA's softmax scale (exact: no rounding of q) and the V scale applied to the output."""

    dtype: torch.dtype | None = None  # None: the cache is in the model dtype
    k_scale: float = 1.0
    v_scale: float = 1.0
    head_dim: int = 0

    def widen(self, cached: torch.Tensor) -> torch.Tensor:
        return cached if self.dtype is None else cached.to(self.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.dtype is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        scale = self.k_scale / self.head_dim**0.5
        o = F.scaled_dot_product_attention(q, self.widen(k), self.widen(v), attn_mask=mask, scale=scale)
        return o if self.v_scale == 1.0 else o.mul_(self.v_scale)


_PLAIN = _Reader()


def _attend_chunks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    out: torch.Tensor,
    reader: _Reader = _PLAIN,
) -> None:
    """Each long prefill chunk alone over its own cache line (already written), into ``out``."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    groups = num_heads // num_kv_heads
    for c in meta.chunks:
        n = c.num_tokens
        qc = q[c.token_start : c.token_start + n]
        qf = qc.view(n, num_kv_heads, groups, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, -1, head_dim)
        kc = k_cache[c.slot : c.slot + 1, :, : c.ctx_len]
        vc = v_cache[c.slot : c.slot + 1, :, : c.ctx_len]
        o = reader.attend(qf, kc, vc, c.masks[window])
        out[c.token_start : c.token_start + n] = (
            o.view(num_kv_heads, groups, n, head_dim).permute(2, 0, 1, 3).reshape(n, -1)
        )


def _attend_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    b: _BatchedRows,
    window: int | None,
    num_kv_heads: int,
    groups: int,
    reader: _Reader = _PLAIN,
) -> torch.Tensor:
    """q (B*Q, Hq, D) in (row, query) order -> (B*Q, Hq * D)."""
    rows, queries, head_dim = b.num_rows, b.num_queries, q.shape[-1]
    qf = (
        q.view(rows, queries, num_kv_heads, groups, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(rows, num_kv_heads, groups * queries, head_dim)
    )
    if b.slot_start is not None:  # consecutive slots: a view of the cache lines, no copy
        kc = k_cache[b.slot_start : b.slot_start + rows, :, : b.ctx_len]
        vc = v_cache[b.slot_start : b.slot_start + rows, :, : b.ctx_len]
    else:
        kc = k_cache[:, :, : b.ctx_len].index_select(0, b.slots)
        vc = v_cache[:, :, : b.ctx_len].index_select(0, b.slots)
    o = reader.attend(qf, kc, vc, b.mask(window))
    return (
        o.view(rows, num_kv_heads, groups, queries, head_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(rows * queries, num_kv_heads * groups * head_dim)
    )


def alternatives_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    alts: DraftAlternatives,
    window: int | None,
    kv_scales: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Draft alternatives' attention on the layer path: q (A, Hq, D), k/v (A, Hkv, D) -> (A, Hq * D).
    Alternative a sees its slot's keys before ``positions[a]`` (within the window) and itself. A few
    tokens per step at small batch, so a loop of small SDPA calls is fine."""
    num_alts, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    groups = num_heads // num_kv_heads
    out = q.new_empty(num_alts, num_heads * head_dim)
    reader = _PLAIN
    if kv_quant.is_fp8(k_cache.dtype):  # the alternative's own K/V go through fp8 too, as if it were cached
        k_scale, v_scale = kv_scales or (1.0, 1.0)
        k = kv_quant.quantize(k, k_scale, k_cache.dtype)
        v = kv_quant.quantize(v, v_scale, v_cache.dtype)
        reader = _Reader(q.dtype, k_scale, v_scale, head_dim)
    slots, positions = alts.slots.tolist(), alts.positions.tolist()
    for a in range(num_alts):
        pos = positions[a]
        lo = max(0, pos - window + 1) if window is not None else 0
        keys = torch.cat((k_cache[slots[a], :, lo:pos], k[a, :, None]), dim=1)  # (Hkv, n, D)
        values = torch.cat((v_cache[slots[a], :, lo:pos], v[a, :, None]), dim=1)
        query = q[a].view(num_kv_heads, groups, head_dim)  # GQA folded into the query axis
        out[a] = reader.attend(query, keys, values, None).reshape(-1)
    return out
