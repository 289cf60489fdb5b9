"""The fused multi-LoRA kernel (csrc/lora.c) against the torch reference, on every ISA path this CPU runs, and
the stack's use of it: a mixed step (base rows and several adapters of different ranks) adds each row's own
``B (A x)`` whether the kernel runs or the torch GEMMs do (``none``)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from nxdserve.engine.models import cpu_build, cpu_kernels, cpu_weight_kernels
from nxdserve.engine.models.spec import ModelSpec
from nxdserve.lora.stack import KERNEL_MAX_TOKENS, LINEARS, LoraStack
from nxdserve.model_files import load_hf_config
from tests.helpers.cpu_paths import forced_cpu_path
from tests.helpers.tiny_model import tiny_model_path
from tests.lora.test_lora_stack import _adapter, _reference

KERNEL_PATHS = [p for p in cpu_build.runnable_paths() if p != "none"]


@pytest.fixture(params=cpu_build.runnable_paths())
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    with forced_cpu_path(request.param) as isa:
        yield isa


def _operands(
    gen: torch.Generator, ranks: list[int], rank: int, fan_in: int, starts: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked A (n, S*rank, in) and B transposed (n, rank, out) for adapters of ``ranks``, NaN past each
    adapter's own rank: the kernel must read only an adapter's own rows."""
    parts, fan_out = len(starts) - 1, starts[-1]
    a = torch.full((len(ranks), parts, rank, fan_in), float("nan"))
    b_t = torch.full((len(ranks), rank, fan_out), float("nan"))
    for i, r in enumerate(ranks):
        a[i, :, :r] = torch.randn(parts, r, fan_in, generator=gen) / math.sqrt(fan_in)
        b_t[i, :r] = torch.randn(r, fan_out, generator=gen)
    return a.reshape(len(ranks), parts * rank, fan_in).to(dtype), b_t.to(dtype)


def _expected(
    x: torch.Tensor,
    idx: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    ranks: torch.Tensor,
    scale: torch.Tensor,
    starts: list[int],
) -> torch.Tensor:
    """The delta of each row in float64: per packed slice p, ``scale * B_p (A_p x)`` over the row's adapter's
    own rank; nothing for idx -1."""
    rmax = b_t.shape[1]
    delta = torch.zeros(x.shape[0], b_t.shape[2], dtype=torch.float64)
    for m, ad in enumerate(idx.tolist()):
        if ad < 0:
            continue
        r = int(ranks[ad])
        for p in range(len(starts) - 1):
            cols = slice(starts[p], starts[p + 1])
            shrunk = a[ad, p * rmax : p * rmax + r].double() @ x[m].double() * float(scale[ad])
            delta[m, cols] = shrunk @ b_t[ad, :r, cols].double()
    return delta


@pytest.mark.parametrize("path", KERNEL_PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 3, 8, 33])
def test_kernel_adds_each_rows_adapter(path: str, dtype: torch.dtype, num_rows: int) -> None:
    """qkv-like packing (3 slices of unequal widths, a tail past the 64-column blocks), 3 adapters of ranks 4, 8
    and 6 in buffers of rank 8, rslora-style scales, rows mixed with base rows; x with a row stride past its
    width."""
    gen = torch.Generator().manual_seed(num_rows)
    fan_in, starts, ranks = 77, [0, 96, 128, 163], [4, 8, 6]
    a, b_t = _operands(gen, ranks, 8, fan_in, starts, dtype)
    scale = torch.tensor([2.0 / math.sqrt(r) for r in ranks], dtype=torch.float32)
    idx = torch.tensor([[0, -1, 2, 1, 2, 0][m % 6] for m in range(num_rows)], dtype=torch.int32)
    x = torch.randn(num_rows, fan_in + 5, generator=gen).to(dtype)[:, :fan_in]
    base = torch.randn(num_rows, starts[-1], generator=gen).to(dtype)
    out = base.clone()
    ranks_t = torch.tensor(ranks, dtype=torch.int32)
    args = cpu_weight_kernels.lora_args(a, b_t, ranks_t, torch.tensor(starts), scale)
    cpu_weight_kernels.lora_add(args, out, x, idx)
    expected = base.double() + _expected(x, idx, a, b_t, ranks_t, scale, starts)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    assert torch.equal(out[idx < 0], base[idx < 0])  # base rows untouched, bit for bit


@pytest.mark.parametrize("path", KERNEL_PATHS, indirect=True)
def test_kernel_without_scale_and_with_many_rows(path: str) -> None:
    """scale NULL (folded into B, the stack's case) and a step large enough to run on every thread, its s
    buffer past the stack array (malloc'd)."""
    gen = torch.Generator().manual_seed(3)
    fan_in, starts, rows = 200, [0, 300, 600], 300
    a, b_t = _operands(gen, [16, 16], 16, fan_in, starts, torch.float32)
    idx = torch.tensor([m % 3 - 1 for m in range(rows)], dtype=torch.int32)
    x, base = torch.randn(rows, fan_in, generator=gen), torch.randn(rows, starts[-1], generator=gen)
    out = base.clone()
    ranks = torch.tensor([16, 16], dtype=torch.int32)
    cpu_weight_kernels.lora_add(cpu_weight_kernels.lora_args(a, b_t, ranks, torch.tensor(starts)), out, x, idx)
    expected = base.double() + _expected(x, idx, a, b_t, ranks, torch.ones(2), starts)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return ModelSpec.from_hf_config(load_hf_config(tiny_model_path("llama")))


@pytest.mark.parametrize("num_tokens", [1, 3, 8, 33])
def test_stack_step_on_every_path(path: str, spec: ModelSpec, num_tokens: int) -> None:
    """The stack's step runs the kernel on the kernel paths (the torch GEMMs on ``none``) and adds each token's
    own adapter: three adapters of ranks 4, 8 and 2 over different modules and layers, base tokens between."""
    attn = _adapter(spec, 1, 4, ("q_proj", "v_proj", "o_proj"), range(spec.num_layers))
    mlp_first_layer = _adapter(spec, 2, 8, ("gate_proj", "up_proj", "down_proj"), range(1))
    everything = _adapter(spec, 3, 2, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                          range(spec.num_layers))
    stack = LoraStack(spec, 4, 16, torch.float32, torch.device("cpu"))
    adapters = (attn, mlp_first_layer, everything)
    slots = {a.int_id: stack.slot_for(a, set()) for a in adapters}
    by_slot = {slots[a.int_id]: a for a in adapters} | {-1: None}
    pattern = [slots[1], -1, slots[2], slots[3], slots[1], slots[3], -1]
    token_slots = np.array([pattern[i % len(pattern)] for i in range(num_tokens)])
    step = stack.step(token_slots)
    assert step is not None
    assert (step.kernel is not None) == (path != "none" and num_tokens <= KERNEL_MAX_TOKENS)
    gen = torch.Generator().manual_seed(num_tokens)
    for layer in range(spec.num_layers):
        for linear in LINEARS:
            fan_in, fan_out, _ = stack.layout[linear]
            x = torch.randn(num_tokens, fan_in, generator=gen)
            base = torch.randn(num_tokens, fan_out, generator=gen)
            got = step.add(base.clone(), layer, linear, x) - base
            if num_tokens > 1:  # a leading part of the step's tokens (the last layer's selected rows)
                head = step.add(base[:1].clone(), layer, linear, x[:1]) - base[:1]
                torch.testing.assert_close(head, got[:1], rtol=1e-5, atol=1e-5)
            for t, slot in enumerate(token_slots):
                expected = _reference(spec, by_slot[int(slot)], layer, linear, x[t])
                torch.testing.assert_close(got[t].double(), expected, rtol=1e-4, atol=1e-4)


def test_stack_kernel_in_bf16(spec: ModelSpec) -> None:
    """A bf16 stack: the kernel (fp32 sums, one rounding) and the torch path (the stack with ``use_kernel`` off)
    are both within bf16 rounding of the float64 reference (the output's own rounding dominates both)."""
    if not cpu_kernels.available():
        pytest.skip("no CPU kernels")
    adapters = [_adapter(spec, i, r, ("q_proj", "k_proj", "v_proj", "down_proj"), range(spec.num_layers))
                for i, r in ((1, 4), (2, 8))]
    token_slots = np.array([0, -1, 1, 1, 0])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, spec.hidden_size, generator=gen).bfloat16()
    base = torch.randn(5, spec.q_size + 2 * spec.kv_size, generator=gen).bfloat16()
    deltas = []
    for use_kernel in (True, False):
        stack = LoraStack(spec, 2, 8, torch.bfloat16, torch.device("cpu"))
        stack.use_kernel = use_kernel
        assert [stack.slot_for(a, set()) for a in adapters] == [0, 1]
        step = stack.step(token_slots)
        assert step is not None and (step.kernel is not None) == use_kernel
        deltas.append(step.add(base.clone(), 1, "qkv", x).double() - base.double())
    expected = torch.stack([_reference(spec, None if s < 0 else adapters[s], 1, "qkv", x[t].float())
                            for t, s in enumerate(token_slots)])
    scale = float(expected.abs().max())
    for delta in deltas:
        assert (delta - expected).abs().max().item() <= 0.01 * scale


@pytest.mark.parametrize("path", KERNEL_PATHS, indirect=True)
def test_kernel_refuses_activations_of_another_dtype(path: str) -> None:
    a, b_t = torch.zeros(1, 4, 8), torch.zeros(1, 4, 8)
    args = cpu_weight_kernels.lora_args(a, b_t, torch.tensor([4], dtype=torch.int32), torch.tensor([0, 8]))
    out = torch.zeros(1, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"adapters' torch\.float32"):
        cpu_weight_kernels.lora_add(
            args, out, torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int32)
        )
    assert not out.any()
