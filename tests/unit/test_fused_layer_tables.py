"""The fused forwards' pointer tables (``fused_decode``, ``fused_qdecode``) follow the KV cache they are given.

A table holds each layer's K/V base, so it is rebuilt for another cache. Keyed on the cache's address alone, it
was reused for a new cache that got a freed one's address with another shape (a runner per text of its own length,
as the perplexity tools make): the forward wrote K/V at the old layout's layer offsets, past the new cache's end,
and corrupted the heap (aborts in malloc on an AVX512-BF16 machine)."""

from __future__ import annotations

import pytest
import torch

from nxdserve.engine.models import cpu_kernels, fused_decode, fused_qdecode, quant
from nxdserve.engine.models.attention import SlotKVCache
from nxdserve.engine.models.llama import LlamaFamilyModel
from tests.helpers.tiny_model import slot_meta, tiny_model_path

PROMPT = 6


def _model(kind: str) -> LlamaFamilyModel:
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    model = LlamaFamilyModel.from_pretrained(tiny_model_path("llama"), dtype, torch.device("cpu"), 64)
    if kind == "int8":
        quant.quantize_model(model, "int8")
    return model


def _at_same_address(cache: SlotKVCache, model: LlamaFamilyModel, max_len: int) -> SlotKVCache:
    """A zeroed cache of ``max_len`` positions whose data starts where ``cache``'s does (as a new cache can once
    the old one is freed): its layers start at other offsets."""
    other = model.new_kv_cache(1, max_len)
    other.data = cache.data.view(-1)[: other.data.numel()].view(other.data.shape).zero_()
    assert other.layout != cache.layout and other.data.data_ptr() == cache.data.data_ptr()
    return other


def _steps(model: LlamaFamilyModel, cache: SlotKVCache, max_len: int) -> torch.Tensor:
    """A prompt, then one decode step (the step the fused forwards take on every build that has them)."""
    torch.manual_seed(3)
    prompt = torch.randint(0, model.vocab_size, (PROMPT + 1,))
    with torch.inference_mode():
        model(prompt[:PROMPT], slot_meta(model, [0], [0], [PROMPT], max_len), cache)
        return model(prompt[PROMPT:], slot_meta(model, [0], [PROMPT], [1], max_len), cache)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_cache_at_a_freed_caches_address_gets_its_own_table(kind: str) -> None:
    fused = fused_decode.available() if kind == "bf16" else cpu_kernels.available() and fused_qdecode.enabled
    if not fused:
        pytest.skip(f"no fused {kind} forward on this machine")
    model = _model(kind)
    first = model.new_kv_cache(1, 64)
    _steps(model, first, 64)  # builds the table for the 64-position layout
    reused = _at_same_address(first, model, 16)
    got = _steps(model, reused, 16)
    fresh = model.new_kv_cache(1, 16)
    want = _steps(model, fresh, 16)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for layer in range(len(model.layers)):  # every layer's K/V where this cache's layout puts them
        for got_kv, want_kv in zip(reused.layer(layer), fresh.layer(layer), strict=True):
            assert torch.equal(got_kv, want_kv), layer


def test_an_fp8_cache_at_a_bf16_caches_address_gets_its_own_table() -> None:
    """Same address, same shape, one byte an element instead of two: its layers start at half the offsets."""
    if not fused_decode.available():
        pytest.skip("no fused bf16 forward on this machine")
    model = _model("bf16")
    first = model.new_kv_cache(1, 64)
    _steps(model, first, 64)
    reused = model.new_kv_cache(1, 64, torch.float8_e4m3fn)
    codes = first.data.view(-1).view(torch.uint8)[: first.data.numel()]  # the first half of its bytes
    reused.data = codes.view(first.data.shape).view(torch.float8_e4m3fn).zero_()
    assert reused.data.shape == first.data.shape and reused.data.data_ptr() == first.data.data_ptr()
    got = _steps(model, reused, 64)
    fresh = model.new_kv_cache(1, 64, torch.float8_e4m3fn)
    want = _steps(model, fresh, 64)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(reused.data.view(torch.uint8), fresh.data.view(torch.uint8))


# The table also reads the layers' weights through pointers (the bf16 forward: each weight's packed copy, rebuilt
# by gemm.kept after an in-place write). Keyed on the first layer's weight alone, it missed a later layer's
# weight written in place or replaced, and a bias set on a later layer: the forward read the old values, or
# memory freed since.


def _step_against_layer_path(model: LlamaFamilyModel, cache: SlotKVCache) -> None:
    """A step into ``cache`` (the same one each time: the table's key stays that cache's) equals the layer path's."""
    got = _steps(model, cache, 64)
    try:
        fused_decode.enabled = fused_qdecode.enabled = False
        want = _steps(model, model.new_kv_cache(1, 64), 64)
    finally:
        fused_decode.enabled = fused_qdecode.enabled = True
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def _fused_or_skip(kind: str) -> tuple[LlamaFamilyModel, SlotKVCache]:
    fused = fused_decode.available() if kind == "bf16" else cpu_kernels.available() and fused_qdecode.enabled
    if not fused:
        pytest.skip(f"no fused {kind} forward on this machine")
    model = _model(kind)
    cache = model.new_kv_cache(1, 64)
    _step_against_layer_path(model, cache)  # the table is built
    return model, cache


def test_a_later_layers_weight_written_in_place_is_read_again() -> None:
    model, cache = _fused_or_skip("bf16")
    with torch.no_grad():
        model.layers[-1].down_weight.mul_(-2.0)
    _step_against_layer_path(model, cache)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_later_layers_replaced_weight_is_read(kind: str) -> None:
    model, cache = _fused_or_skip(kind)
    last = model.layers[-1]
    old = last.down_weight
    dense = old.dequantize(torch.float32) if isinstance(old, quant.QuantLinear) else old.detach().float()
    last.down_weight = None
    del old
    replaced = -2.0 * dense
    last.down_weight = (
        quant.quantize(replaced, kind)
        if kind != "bf16"
        else torch.nn.Parameter(replaced.to(torch.bfloat16), requires_grad=False)
    )
    _step_against_layer_path(model, cache)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_bias_set_on_a_later_layer_is_read(kind: str) -> None:
    model, cache = _fused_or_skip(kind)
    last = model.layers[-1]
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    torch.manual_seed(5)
    last.o_bias = torch.nn.Parameter(torch.randn(model.spec.hidden_size, dtype=dtype), requires_grad=False)
    _step_against_layer_path(model, cache)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_the_table_keeps_the_objects_its_key_names_alive(kind: str) -> None:
    """The key holds object ids: were a replaced linear freed while the table lives, a new one could take its
    id, and with it the old table and its pointers into freed memory."""
    import weakref

    model, _ = _fused_or_skip(kind)
    last = model.layers[-1]
    replaced = weakref.ref(last.down_weight)
    last.down_weight = None  # no fused forward can run now; the table is the only holder left
    assert replaced() is not None
