"""The forward's LoRA buffers and the grouped (punica-style) shrink/expand over a mixed batch.

Each of a layer's four fused linears (qkv, o, gate_up, down) has stacked buffers over ``max_loras``
adapter slots: A (layers, max_loras, S*r, in) and B (layers, max_loras, out, S*r), S being the number of
PEFT modules packed in that linear (3 for q/k/v) and r the maximum rank; a smaller rank or an untargeted
module is zero-padded, which adds exact zeros. One step's adapters are gathered once (cached while the
set is the same, the common case in decode); then per layer and linear:

    shrink: buf = x @ A_active^T          (T, K*S*r)   one GEMM for all K adapters in the step
    group:  buf *= one_hot(token adapter)  (T, K, S*r)  each token keeps only its own adapter's block
    expand: y += buf @ B_active^T          (T, out)     one GEMM writes every packed slice

So a step costs two small GEMMs of width K*S*r per linear, whatever the number of rows, with no Python
per request; steps with no adapter row skip all of it (``LoraStep`` is None). The gather trims r to the
largest rank among the step's adapters (the padding is exact zeros: reading it would only cost bandwidth) and
leaves out the (layer, linear) pairs none of them targets, which then cost nothing. From
``PER_ADAPTER_MIN_TOKENS`` tokens with several adapters, each adapter instead runs its own shrink and expand on
its own rows (the grouped GEMMs make every token pay for all K blocks): measured on SmolLM2-135M's shapes,
K=4 + base rows, one thread, LoRA time per step per-adapter/grouped 0.98 at 16 tokens, 0.85 at 32, 0.67 at 64,
1.07-1.10 at 5-8.

On the CPU with the C kernels (``cpu_kernels.available()``), steps of up to ``KERNEL_MAX_TOKENS`` tokens run
instead one fused call per linear (``csrc/lora.c``, punica's BGMV idea): each row runs its own adapter's shrink
(the packed modules sharing one pass over x) and expand, reading only its adapter's own rank, straight from the
resident buffers: A as above, and B kept a second time transposed per module, ``b_t`` (layers, max_loras, r, out),
written when an adapter is loaded. So that path gathers nothing per step, and a step costs each row one adapter's
flops whatever the mix (the grouped GEMMs: all K adapters'), in one call per linear instead of two GEMMs.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from nxdserve.engine.models import cpu_kernels, cpu_weight_kernels
from nxdserve.engine.models.spec import ModelSpec
from nxdserve.errors import LoRAAdapterError
from nxdserve.lora.adapter import TARGETS, LoraAdapter

LINEARS = ("qkv", "o", "gate_up", "down")
# From this many tokens, a step with several adapters runs each adapter's GEMMs on its own rows (gather, shrink,
# expand, index_add: 4 ops per adapter) instead of the grouped GEMMs over every row, whose flops and weight reads
# grow with K (each token pays for all K adapters' blocks, then masks K-1 of them away).
PER_ADAPTER_MIN_TOKENS = 16
# Up to this many tokens, a step on the CPU runs the fused C kernel per linear (see the module docstring);
# longer steps (prefill chunks) keep torch's GEMMs, whose blocking reuses each weight across many rows.
KERNEL_MAX_TOKENS = 64
Operands = tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor] | None]]


def _layout(spec: ModelSpec) -> dict[str, tuple[int, int, list[int]]]:
    """linear -> (in_features, out_features, start of each packed slice in the output)."""
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    return {
        "qkv": (h, q + 2 * kv, [0, q, q + kv, q + 2 * kv]),
        "o": (q, h, [0, h]),
        "gate_up": (h, 2 * i, [0, i, 2 * i]),
        "down": (i, h, [0, h]),
    }


class LoraStack:
    """Device buffers for ``max_loras`` resident adapters, managed least-recently-used."""

    def __init__(
        self, spec: ModelSpec, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.spec = spec
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layout = _layout(spec)
        r, n = max_rank, spec.num_layers
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for linear, (fan_in, fan_out, starts) in self.layout.items():
            width = (len(starts) - 1) * r
            self.a[linear] = torch.zeros(n, max_loras, width, fan_in, dtype=dtype, device=device)
            self.b[linear] = torch.zeros(n, max_loras, fan_out, width, dtype=dtype, device=device)
        # The kernel's operands, where it can run: B transposed per module (layers, max_loras, r, out), each
        # slot's rank, and the args of every (layer, linear), pointing into these buffers.
        self.b_t: dict[str, torch.Tensor] = {}
        self.ranks = torch.zeros(max_loras, dtype=torch.int32)
        self.kernel_args: list[dict[str, cpu_kernels.LoraArgs]] = []
        self.use_kernel = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
        if self.use_kernel:
            for linear, (_, fan_out, _) in self.layout.items():
                self.b_t[linear] = torch.zeros(n, max_loras, r, fan_out, dtype=dtype, device=device)
            bounds = {linear: torch.tensor(layout[2], dtype=torch.int64) for linear, layout in self.layout.items()}
            self.kernel_args = [
                {
                    linear: cpu_weight_kernels.lora_args(self.a[linear][layer], self.b_t[linear][layer], self.ranks,
                                                         bounds[linear])
                    for linear in LINEARS
                }
                for layer in range(n)
            ]  # fmt: skip
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter int id -> buffer slot, oldest first
        self.slot_rank = [0] * max_loras  # the rank written in each slot: columns past it are zeros
        self.slot_targets: list[set[tuple[int, str]]] = [set() for _ in range(max_loras)]  # (layer, linear)
        self._gathered: tuple[tuple[int, ...], list[dict[str, Operands]]] | None = None
        self._kernel_targets: tuple[tuple[int, ...], list[dict[str, cpu_kernels.LoraArgs]]] | None = None

    # -- residency ---------------------------------------------------------------------------------
    def slot_for(self, adapter: LoraAdapter, in_use: set[int]) -> int:
        """The buffer slot holding ``adapter``, copying it in (over the least recently used slot that no
        running row uses) when it is not resident. ``in_use``: buffer slots running rows point at."""
        slot = self.resident.get(adapter.int_id)
        if slot is not None:
            self.resident.move_to_end(adapter.int_id)
            return slot
        # A slot whose adapter was unloaded stays untouched while running rows still use it.
        taken = set(self.resident.values()) | in_use
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next((i for i, s in self.resident.items() if s not in in_use), None)
            if victim is None:
                raise LoRAAdapterError(f"more than max_loras={self.max_loras} adapters in one batch")
            slot = self.resident.pop(victim)
        self._write(slot, adapter)
        self.resident[adapter.int_id] = slot
        return slot

    def evict(self, int_id: int) -> None:
        self.resident.pop(int_id, None)

    @torch.no_grad()
    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise LoRAAdapterError(f"LoRA rank {adapter.rank} is greater than max_lora_rank {self.max_rank}")
        r = self.max_rank
        for linear in LINEARS:
            self.a[linear][:, slot].zero_()
            self.b[linear][:, slot].zero_()
            if linear in self.b_t:
                self.b_t[linear][:, slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            linear, part = TARGETS[module]
            starts = self.layout[linear][2]
            cols = slice(part * r, part * r + adapter.rank)
            self.a[linear][layer, slot, cols] = a.to(self.a[linear].dtype)
            self.b[linear][layer, slot, starts[part] : starts[part + 1], cols] = b.to(self.b[linear].dtype)
            if linear in self.b_t:
                b_t = self.b_t[linear][layer, slot, : adapter.rank, starts[part] : starts[part + 1]]
                b_t.copy_(b.t().to(b_t.dtype))
        self.slot_rank[slot] = adapter.rank
        self.ranks[slot] = adapter.rank
        self.slot_targets[slot] = {(layer, TARGETS[module][0]) for layer, module in adapter.weights}
        self._gathered = self._kernel_targets = None  # the slot's contents changed

    # -- one step ----------------------------------------------------------------------------------
    def _kernel_step(self, token_slots: np.ndarray, key: tuple[int, ...]) -> LoraStep:
        """The fused kernel's step: the (layer, linear) pairs some active adapter targets, each token's slot."""
        if self._kernel_targets is None or self._kernel_targets[0] != key:
            targeted = set().union(*(self.slot_targets[s] for s in key))
            per_layer = [{linear: args for linear, args in layer_args.items() if (layer, linear) in targeted}
                         for layer, layer_args in enumerate(self.kernel_args)]  # fmt: skip
            self._kernel_targets = (key, per_layer)
        rows = torch.from_numpy(token_slots.astype(np.int32))  # the slots index the buffers directly
        step = LoraStep([], None, len(key), kernel=(self._kernel_targets[1], rows))
        step.num_tokens = token_slots.shape[0]
        return step

    def step(self, token_slots: np.ndarray) -> LoraStep | None:
        """``token_slots`` (T,): each token's buffer slot, -1 for base-model tokens. None: no adapter token."""
        on = token_slots >= 0
        if not on.any():
            return None
        active = np.unique(token_slots[on])
        key = tuple(active.tolist())
        kernel = self.use_kernel and bool(self.kernel_args) and cpu_kernels.available()
        if kernel and token_slots.shape[0] <= KERNEL_MAX_TOKENS:
            return self._kernel_step(token_slots, key)
        if self._gathered is None or self._gathered[0] != key:
            index = torch.from_numpy(active).to(self.a["qkv"].device)
            # Only the columns up to the largest active rank (the rest are zero padding: reading them would cost
            # bandwidth for exact zeros), and only the (layer, linear) pairs some active adapter targets.
            rank = max(self.slot_rank[s] for s in key)
            targeted = set().union(*(self.slot_targets[s] for s in key))
            gathered: list[dict[str, Operands]] = [{} for _ in range(self.spec.num_layers)]
            for linear in LINEARS:
                a = self.a[linear].index_select(1, index)  # (L, K, S*r, in)
                b = self.b[linear].index_select(1, index)  # (L, K, out, S*r)
                n, k, width, fan_in = a.shape
                parts, fan_out = width // self.max_rank, b.shape[2]
                a = a.view(n, k, parts, self.max_rank, fan_in)[:, :, :, :rank]
                b = b.view(n, k, fan_out, parts, self.max_rank)[..., :rank]
                a_t = a.reshape(n, k * parts * rank, fan_in).transpose(1, 2).contiguous()  # (L, in, K*S*rank)
                b_t = b.reshape(n, k, fan_out, parts * rank).permute(0, 1, 3, 2).reshape(n, -1, fan_out).contiguous()
                w = parts * rank
                for layer in range(n):
                    if (layer, linear) in targeted:
                        # Each adapter's own block too (views: a column block of A, a row block of B), or None
                        # where that adapter leaves this linear alone: the per-adapter path of large steps.
                        own = [
                            (a_t[layer][:, i * w : (i + 1) * w], b_t[layer][i * w : (i + 1) * w])
                            if (layer, linear) in self.slot_targets[slot] else None
                            for i, slot in enumerate(key)
                        ]
                        gathered[layer][linear] = (a_t[layer], b_t[layer], own)
            self._gathered = (key, gathered)
        if active.size == 1 and on.all():  # every token on one adapter (e.g. a single stream): nothing to mask
            return LoraStep(self._gathered[1], None, 1)
        device = self.a["qkv"].device
        if active.size > 1 and token_slots.shape[0] >= PER_ADAPTER_MIN_TOKENS:
            rows = [torch.from_numpy(np.flatnonzero(token_slots == slot)).to(device) for slot in active]
            step = LoraStep(self._gathered[1], None, active.size, rows)
            step.num_tokens = token_slots.shape[0]
            return step
        local = np.searchsorted(active, np.where(on, token_slots, active[0]))
        one_hot = torch.zeros(token_slots.shape[0], active.size, dtype=self.a["qkv"].dtype)
        one_hot[torch.from_numpy(np.flatnonzero(on)), torch.from_numpy(local[on])] = 1
        return LoraStep(self._gathered[1], one_hot.to(device), active.size)


class LoraStep:
    """One forward's adapters, shared by all layers (``AttentionMetadata.lora``).

    The per-layer operands are split out once per gathered adapter set: at one token a layer's four ``add``
    calls are then four shrink and four expand GEMMs and nothing else, where indexing the stacked tensors per
    call cost eight more torch dispatches a layer."""

    def __init__(
        self,
        weights: list[dict[str, Operands]],
        one_hot: torch.Tensor | None,
        num_adapters: int,
        rows: list[torch.Tensor] | None = None,
        kernel: tuple[list[dict[str, cpu_kernels.LoraArgs]], torch.Tensor] | None = None,
    ) -> None:
        # The fused kernel's step (weights then unused): each layer's targeted linears' args, each token's slot.
        self.kernel = kernel
        self.weights = weights  # [layer][linear] = (A (in, K*S*r), B (K*S*r, out), per adapter); targeted only
        self.one_hot = one_hot  # (T, K) for the grouped path with several adapters; else None
        self.num_adapters = num_adapters
        self.rows = rows  # the per-adapter path: each active adapter's token indices
        self.num_tokens = 0 if one_hot is None else one_hot.shape[0]
        self._mask = None if one_hot is None else one_hot[:, :, None]  # (T, K, 1), broadcast over S*r

    def add(self, out: torch.Tensor, layer: int, linear: str, x: torch.Tensor) -> torch.Tensor:
        """``out += B (A x)`` with each token's own adapter, for ``linear`` of ``layer``. ``out`` must be a fresh
        tensor (a linear's output): it is updated in place and returned."""
        if self.kernel is not None:
            args = self.kernel[0][layer].get(linear)
            if args is not None:
                rows, t = self.kernel[1], x.shape[0]
                x = x if x.stride(-1) == 1 else x.contiguous()
                cpu_weight_kernels.lora_add(args, out, x, rows if t == self.num_tokens else rows[:t])
            return out
        operands = self.weights[layer].get(linear)
        if operands is None:  # no active adapter targets it
            return out
        a, b, own = operands
        if self.rows is not None:
            t = x.shape[0]
            for rows, pair in zip(self.rows, own, strict=True):
                if pair is not None:
                    if t != self.num_tokens:  # a leading part of the step's tokens
                        rows = rows[rows < t]
                    out.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), pair[0]), pair[1]))
            return out
        buf = torch.mm(x, a)  # shrink: (T, K*S*r)
        mask = self._mask
        if mask is not None:
            t = buf.shape[0]
            buf.view(t, self.num_adapters, -1).mul_(mask if mask.shape[0] == t else mask[:t])
        return out.addmm_(buf, b)  # expand
