"""The CPU slot-attention kernel and the packed linear against plain torch."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from nxdserve.engine.models import cpu_kernels
from nxdserve.engine.models.linear import drop_packed, linear, packed_weight

needs_kernel = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler for the CPU kernels"
)


@needs_kernel
def test_kernels_compile() -> None:
    assert cpu_kernels.available(), "a C compiler is installed but the CPU kernels did not build (see the log)"


def reference(q, k_cache, v_cache, slots, positions, select, window):
    """Each selected token against keys lo..pos of its slot, one SDPA call per token."""
    groups = q.shape[1] // k_cache.shape[1]
    out = {}
    for t in select:
        s, p = int(slots[t]), int(positions[t])
        lo = max(0, p - window + 1) if window else 0
        kc = k_cache[s, :, lo : p + 1].repeat_interleave(groups, dim=0).float()
        vc = v_cache[s, :, lo : p + 1].repeat_interleave(groups, dim=0).float()
        o = F.scaled_dot_product_attention(q[t].float()[:, None], kc, vc)  # (Hq, 1, D)
        out[t] = o[:, 0].reshape(-1)
    return out


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "groups", "window"), [(64, 3, None), (128, 4, None), (16, 2, 5), (40, 1, None)])
def test_slot_attention_matches_sdpa(dtype: torch.dtype, head_dim: int, groups: int, window: int | None) -> None:
    gen = torch.Generator().manual_seed(head_dim + groups)
    num_slots, kv_heads, max_len = 5, 2, 40
    k_cache = torch.randn(num_slots, kv_heads, max_len, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, max_len, head_dim, generator=gen).to(dtype)
    # Rows: slot 3 decodes at 17, slot 0 verifies 3 tokens at 30..32, slot 4 decodes at 0, slot 1 a chunk.
    slots = torch.tensor([3, 0, 0, 0, 4, 1, 1, 1, 1])
    positions = torch.tensor([17, 30, 31, 32, 0, 5, 6, 7, 8])
    num_tokens = slots.numel()
    # q/k/v as strided views of one projection, as the model passes them.
    qkv = torch.randn(num_tokens, kv_heads * (groups + 2), head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([kv_heads * groups, kv_heads, kv_heads], dim=1)
    select = torch.tensor([0, 1, 2, 3, 4])  # the chunk's tokens are not attended here
    out = torch.zeros(num_tokens, kv_heads * groups * head_dim, dtype=dtype)
    kc, vc = k_cache.clone(), v_cache.clone()
    cpu_kernels.slot_attention(q, k, v, kc, vc, slots, positions, select, select.numel(), window, out)

    written_k, written_v = k_cache.clone(), v_cache.clone()
    written_k[slots, :, positions] = k
    written_v[slots, :, positions] = v
    assert torch.equal(kc, written_k) and torch.equal(vc, written_v)
    ref = reference(q, written_k, written_v, slots, positions, select.tolist(), window)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for t, expected in ref.items():
        torch.testing.assert_close(out[t].float(), expected, atol=atol, rtol=0)
    assert not out[5:].any()  # unselected tokens untouched

    # select=None: the first num_select tokens.
    out2 = torch.zeros_like(out)
    cpu_kernels.slot_attention(q, k, v, k_cache.clone(), v_cache.clone(), slots, positions, None, 5, window, out2)
    torch.testing.assert_close(out2, out, atol=0, rtol=0)


def test_packed_linear_is_exact_and_tracks_weight_updates() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(96, 64, generator=gen).to(torch.bfloat16), requires_grad=False)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias), atol=0, rtol=0)
        torch.testing.assert_close(linear(x[None], weight), F.linear(x[None], weight), atol=0, rtol=0)
    with torch.no_grad():
        weight.mul_(2)  # an in-place update makes the packed copy stale
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=0, rtol=0)
    drop_packed(weight)
    trained = torch.nn.Parameter(weight.detach().clone())  # requires grad: never packed
    assert packed_weight(trained) is None
    y = linear(x, trained)
    assert y.requires_grad


@needs_kernel
def test_loading_the_kernels_keeps_denormals() -> None:
    """Linked with -ffast-math, old GCCs make the library switch the process to flush-to-zero."""
    assert cpu_kernels.available()
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0


def _awkward_values(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rounded values (many ties) with NaNs, both zeros and both infinities sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 3).round()
    u = torch.rand(rows, cols, generator=g)
    x[u < 0.002] = float("nan")
    x[(u > 0.1) & (u < 0.2)] = -0.0
    x[(u > 0.2) & (u < 0.21)] = float("inf")
    x[(u > 0.3) & (u < 0.4)] = float("-inf")
    return x.to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_gives_torchs_indices(dtype: torch.dtype) -> None:
    assert cpu_kernels.available()  # else argmax() is torch's own and this proves nothing
    # Row lengths around the vector widths (16 and 32 lanes) and the 64-value search blocks, and the LM head's.
    for seed, cols in enumerate([1, 15, 16, 31, 33, 63, 64, 65, 200, 1000, 49152]):
        x = _awkward_values(5, cols, dtype, seed)
        assert torch.equal(cpu_kernels.argmax(x), x.argmax(dim=-1)), cols
        neg = -x.abs()  # no positive value: the maximum is a zero or a negative number
        assert torch.equal(cpu_kernels.argmax(neg), neg.argmax(dim=-1)), cols
    zeros = torch.zeros(3, 130, dtype=dtype)
    zeros[:, :77] = -0.0  # -0 == +0: the first zero wins, whatever its sign
    assert cpu_kernels.argmax(zeros).tolist() == [0, 0, 0]
    late_nan = torch.zeros(2, 300, dtype=dtype)
    late_nan[0, 250], late_nan[0, 280], late_nan[1, 5] = float("nan"), float("nan"), float("inf")
    assert cpu_kernels.argmax(late_nan).tolist() == [250, 5]


@needs_kernel
def test_argmax_takes_any_leading_shape_and_strided_rows() -> None:
    x = _awkward_values(24, 500, torch.bfloat16, 7)
    three_d = x.reshape(4, 6, 500)
    assert torch.equal(cpu_kernels.argmax(three_d), three_d.argmax(dim=-1))
    sliced = x[::3, 100:400]  # rows strided, last axis contiguous
    assert torch.equal(cpu_kernels.argmax(sliced), sliced.argmax(dim=-1))
    half = x.to(torch.float16)  # no kernel for fp16: torch's own argmax answers
    assert torch.equal(cpu_kernels.argmax(half), half.argmax(dim=-1))
    assert cpu_kernels.argmax(x[:0]).shape == (0,)
