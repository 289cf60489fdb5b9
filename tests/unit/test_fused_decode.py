"""The fused small-batch bf16 forward (``fused_decode``) against the layer-by-layer path and fp32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nxdserve.engine.models import fused_decode
from nxdserve.engine.models.attention import AttentionMetadata, SlotKVCache
from nxdserve.engine.models.llama import LlamaFamilyModel
from tests.helpers.tiny_model import _llama, single_torch_thread, tiny_model_path

needs_fused = pytest.mark.skipif(not fused_decode.available(), reason="no AVX512-BF16 C kernels on this machine")
MAX_LEN = 64
PROMPT_LEN = 20


@pytest.fixture(scope="module")
def odd_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hidden 80 and intermediate 136: projections whose inner size is not a multiple of the kernel's
    32-value chunks (the masked tail), five query heads on one KV head."""
    from transformers import AutoModelForCausalLM

    config = _llama(hidden_size=80, intermediate_size=136, num_attention_heads=5, num_key_value_heads=1,
                    head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
    out = tmp_path_factory.mktemp("odd") / "odd"
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _meta(model: LlamaFamilyModel, slots: list[int], starts: list[int], lens: list[int]) -> AttentionMetadata:
    return AttentionMetadata.build(
        np.array(slots), np.array(starts), np.array(lens),
        num_query_groups=model.spec.num_heads // model.spec.num_kv_heads, windows=model.windows,
        max_len=MAX_LEN, device=torch.device("cpu"), dtype=model.dtype,
    )  # fmt: skip


def _prefilled(model: LlamaFamilyModel, prompts: list[torch.Tensor]) -> SlotKVCache:
    cache = model.new_kv_cache(len(prompts), MAX_LEN)
    for slot, prompt in enumerate(prompts):
        model(prompt, _meta(model, [slot], [0], [prompt.numel()]), cache)  # 20 tokens: the layer path
    return cache


def _step(path: Path, fused: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, ...]:
    """Prefill three slots, then one step of 5 tokens: slot 0 and 1 decode, slot 2 verifies 3 tokens."""
    model = LlamaFamilyModel.from_pretrained(path, dtype, torch.device("cpu"), max_len=MAX_LEN)
    gen = torch.Generator().manual_seed(7)
    vocab = model.vocab_size
    prompts = [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen) for _ in range(3)]
    tokens = torch.randint(0, vocab, (5,), generator=gen)
    monkeypatch.setattr(fused_decode, "enabled", fused)
    with single_torch_thread():
        cache = _prefilled(model, prompts)
        meta = _meta(model, [0, 2, 1], [PROMPT_LEN] * 3, [1, 3, 1])
        with torch.inference_mode():
            assert model.fused_decode.accepts(tokens, meta, cache) == (fused and dtype == torch.bfloat16)
        hidden = model(tokens, meta, cache)
        logits = model.compute_logits(hidden)
    written = cache.data[:, :, :, :, PROMPT_LEN : PROMPT_LEN + 3].float()
    return hidden.float(), logits, written


@needs_fused
@pytest.mark.parametrize("family", ["llama", "llama-llama3-untied", "llama-linear-bias", "mistral-window", "qwen2",
                                    "odd"])
def test_fused_forward_is_as_close_to_fp32_as_the_layer_path(
    family: str, odd_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = odd_model_path if family == "odd" else tiny_model_path(family)
    ref_hidden, ref_logits, ref_kv = _step(path, False, torch.float32, monkeypatch)
    layer_hidden, layer_logits, layer_kv = _step(path, False, torch.bfloat16, monkeypatch)
    fused_hidden, fused_logits, fused_kv = _step(path, True, torch.bfloat16, monkeypatch)
    # Both bf16 paths round at the same places; only the order of fp32 sums inside projections differs.
    # A wrong RoPE, attention span, bias or residual would put the fused path far outside the layer path's
    # error against fp32.
    for fused, layer, ref in ((fused_hidden, layer_hidden, ref_hidden), (fused_logits, layer_logits, ref_logits),
                              (fused_kv, layer_kv, ref_kv)):
        scale = ref.abs().max().item()
        fused_err = (fused - ref).abs().max().item()
        layer_err = (layer - ref).abs().max().item()
        assert fused_err <= 2 * layer_err + 0.02 * scale, (fused_err, layer_err, scale)
        assert (fused - layer).abs().max().item() <= 0.1 * scale
    assert (fused_logits.argmax(-1) == layer_logits.argmax(-1)).float().mean().item() >= 0.6


@needs_fused
def test_fused_forward_is_not_used_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_decode, "enabled", True)
    bf16 = LlamaFamilyModel.from_pretrained(tiny_model_path("llama"), torch.bfloat16, torch.device("cpu"), MAX_LEN)
    fp32 = LlamaFamilyModel.from_pretrained(tiny_model_path("llama"), torch.float32, torch.device("cpu"), MAX_LEN)
    qk_norm = LlamaFamilyModel.from_pretrained(tiny_model_path("qwen3"), torch.bfloat16, torch.device("cpu"), MAX_LEN)
    many = fused_decode.MAX_TOKENS + 1
    one = torch.zeros(1, dtype=torch.long)
    with torch.inference_mode():
        cache = bf16.new_kv_cache(many, MAX_LEN)
        assert bf16.fused_decode.accepts(one, _meta(bf16, [0], [5], [1]), cache)
        assert not bf16.fused_decode.accepts(torch.zeros(many, dtype=torch.long),
                                             _meta(bf16, list(range(many)), [5] * many, [1] * many), cache)
        assert not bf16.fused_decode.accepts(torch.zeros(9, dtype=torch.long), _meta(bf16, [0], [0], [9]), cache)
        # Rows beyond the cache it is given (a slot or a position past its end) go to the checked path.
        assert not bf16.fused_decode.accepts(one, _meta(bf16, [many], [5], [1]), cache)
        assert not bf16.fused_decode.accepts(one, _meta(bf16, [0], [5], [1]), bf16.new_kv_cache(1, 5))
        assert not fp32.fused_decode.accepts(one, _meta(fp32, [0], [5], [1]), fp32.new_kv_cache(1, MAX_LEN))
        assert not qk_norm.fused_decode.accepts(one, _meta(qk_norm, [0], [5], [1]), qk_norm.new_kv_cache(1, MAX_LEN))


@needs_fused
@pytest.mark.parametrize("rows", [1, 3, fused_decode.MAX_TOKENS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_linear_matches_fp32_linear_to_bf16_rounding(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 80, generator=gen).bfloat16()
    weight = torch.randn(101, 80, generator=gen).bfloat16()  # 101 rows: a partial last block of four
    bias = torch.randn(101, generator=gen).bfloat16() if with_bias else None
    with torch.inference_mode():
        out = fused_decode.small_linear(x, weight, bias)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == (rows, 101)
    ref = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(out.float(), ref, rtol=8e-3, atol=1e-2)


@needs_fused
def test_tiled_copy_follows_in_place_weight_updates() -> None:
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    weight = torch.zeros(8, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = fused_decode.small_linear(x, weight, None)
        weight.add_(1.0)  # e.g. weights loaded again: the tiled copy must not be stale
        after = fused_decode.small_linear(x, weight, None)
    assert before is not None and after is not None
    assert before.abs().max().item() == 0.0
    assert torch.equal(after.float(), torch.full((1, 8), 64.0))

