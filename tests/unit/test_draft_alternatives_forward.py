"""Draft alternatives in the forward (``DraftAlternatives``): each must compute exactly what the same token
would as its row's first draft, leave the row's own draft in the cache, and hand back its K/V."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from nxdserve.engine.models import cpu_kernels, fused_decode, kv_quant, quant
from nxdserve.engine.models.attention import DraftAlternatives
from nxdserve.engine.models.runner import SlotModelRunner
from tests.helpers.tiny_model import single_torch_thread, tiny_model_path

MAX_LEN = 48
PROMPT_LEN = 17  # the prompts' last token is fed at position PROMPT_LEN - 1 ...
DRAFT_POS = PROMPT_LEN  # ... and the first draft (or an alternative to it) stands here


def _prefilled(path: Path, dtype: torch.dtype, prompts: list[torch.Tensor], kv: str = "auto") -> SlotModelRunner:
    runner = SlotModelRunner.from_pretrained(path, 3, MAX_LEN, dtype, torch.device("cpu"), kv_cache_dtype=kv)
    for slot, prompt in enumerate(prompts):
        runner.run(prompt[:-1], np.array([slot]), np.array([0]), np.array([PROMPT_LEN - 1]))
    return runner


def _first_draft_run(
    path: Path, dtype: torch.dtype, prompts: list[torch.Tensor], drafts: list[int], kv: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots 0 and 2 verify [last prompt token, draft, one more]: hidden states of the draft tokens and the
    cache (every layer's K/V) at the draft position, per slot."""
    runner = _prefilled(path, dtype, prompts, kv)
    tokens = torch.tensor([int(prompts[0][-1]), drafts[0], 5, int(prompts[2][-1]), drafts[1], 6])
    hidden = runner.run(tokens, np.array([0, 2]), np.array([PROMPT_LEN - 1] * 2), np.array([3, 3]))
    kv = runner.kv_cache.data[:, :, [0, 2], :, DRAFT_POS].clone()
    return hidden[[1, 4]], kv


@pytest.mark.parametrize(
    ("family", "dtype", "fused", "kv"),
    [
        ("llama", torch.float32, False, "auto"),
        ("llama", torch.bfloat16, False, "auto"),
        ("llama", torch.bfloat16, True, "auto"),
        ("llama", torch.bfloat16, False, "fp8"),
        # fp8 on the fused forward: head size 16 widens the line into scratch, SmolLM2's shape reads the codes.
        ("llama", torch.bfloat16, True, "fp8"),
        ("llama-d64-g3", torch.bfloat16, True, "fp8"),
        ("llama-d64-g3", torch.bfloat16, True, "fp8_e5m2"),
    ],
    ids=["fp32-layers", "bf16-layers", "bf16-fused", "bf16-layers-fp8", "bf16-fused-fp8", "bf16-fused-fp8-d64",
         "bf16-fused-e5m2-d64"],
)  # fmt: skip
def test_alternatives_compute_what_the_same_token_would_as_the_first_draft(
    family: str, dtype: torch.dtype, fused: bool, kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if fused and not fused_decode.available():
        pytest.skip("no AVX512-BF16 C kernels on this machine")
    monkeypatch.setattr(fused_decode, "enabled", fused)
    path = tiny_model_path(family)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 200, (PROMPT_LEN,), generator=gen) for _ in range(3)]
    # Slot 0 drafts 40 with alternatives 41 and 42; slot 2 drafts 44 with alternative 43.
    with single_torch_thread():
        runner = _prefilled(path, dtype, prompts, kv)
        # On an fp8 cache the K/V handed back stay in the model's dtype; the cache holds them as codes (scale 1).
        cached = (lambda t: t) if kv == "auto" else (lambda t: kv_quant.quantize(t, 1.0, runner.kv_cache.data.dtype))
        alts = DraftAlternatives(slots=torch.tensor([0, 0, 2]), positions=torch.tensor([DRAFT_POS] * 3))
        tokens = torch.tensor([int(prompts[0][-1]), 40, 5, int(prompts[2][-1]), 44, 6, 41, 42, 43])
        meta = runner.metadata(np.array([0, 2]), np.array([PROMPT_LEN - 1] * 2), np.array([3, 3]))
        meta.alts = alts
        with torch.inference_mode():
            assert runner.model.fused_decode.accepts(tokens, meta, runner.kv_cache) == fused
        hidden = runner.run(tokens, np.array([0, 2]), np.array([PROMPT_LEN - 1] * 2), np.array([3, 3]), alts=alts)
        assert hidden.shape[0] == 9 and alts.kv is not None and alts.kv.dtype == dtype
        own_hidden, own_kv = _first_draft_run(path, dtype, prompts, [40, 44], kv)
        # The rows' own drafts are what the cache holds afterwards, untouched by the alternatives.
        assert torch.equal(_bits(runner.kv_cache.data[:, :, [0, 2], :, DRAFT_POS]), _bits(own_kv))
        torch.testing.assert_close(hidden[[1, 4]], own_hidden, rtol=0, atol=0)
        for a, (slot, token, other) in enumerate([(0, 41, 44), (0, 42, 44), (2, 43, 40)]):
            drafts = [token, other] if slot == 0 else [other, token]
            ref_hidden, ref_kv = _first_draft_run(path, dtype, prompts, drafts, kv)
            i = 0 if slot == 0 else 1
            # The same token in the same place: fp32 agrees to summation order; bf16 measured bit-identical, and
            # allowed a rounding step (the alternative attends alone where the draft may attend in a block).
            tol = 1e-5 if dtype == torch.float32 else 0.01 * ref_hidden.abs().max().item()
            torch.testing.assert_close(hidden[6 + a].float(), ref_hidden[i].float(), rtol=0, atol=tol)
            # fp8: measured the same codes; allowed one step (e5m2's is a quarter of the value) where a bf16
            # rounding step moves a value across a code boundary.
            step = 0 if kv == "auto" else 0.25
            torch.testing.assert_close(
                cached(alts.kv[:, a]).float(), ref_kv[:, :, i].float(), rtol=step, atol=tol
            )
        # An accepted alternative's K/V can replace the draft's.
        alts.install(runner.kv_cache, 2)
        assert torch.equal(_bits(runner.kv_cache.data[:, :, 2, :, DRAFT_POS]), _bits(cached(alts.kv[:, 2])))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Exact comparison for any dtype, fp8 codes included."""
    return t.contiguous().view(torch.uint8)


def test_alternatives_outside_the_cache_are_refused() -> None:
    runner = SlotModelRunner.from_pretrained(tiny_model_path("llama"), 2, MAX_LEN, torch.float32, torch.device("cpu"))
    for slot, position in ((2, 1), (-1, 1), (0, MAX_LEN), (0, -1)):
        alts = DraftAlternatives(slots=torch.tensor([slot]), positions=torch.tensor([position]))
        with pytest.raises(ValueError, match="outside the KV cache"):
            runner.run(torch.tensor([1, 2, 3]), np.array([0]), np.array([0]), np.array([2]), alts=alts)

    # A caller of the model itself: the fused forward, which trusts its indices, declines such a step.
    quant.quantize_model(runner.model, "int8")  # fp32 on int8 codes: the fused quantized forward's model
    meta = runner.metadata(np.array([0]), np.array([0]), np.array([2]))
    fused = runner.model.fused_quant_decode
    with torch.inference_mode():
        for slot, position in ((1, 1), (2, 1), (-1, 1), (0, MAX_LEN), (0, -1)):
            meta.alts = DraftAlternatives(slots=torch.tensor([slot]), positions=torch.tensor([position]))
            inside = (slot, position) == (1, 1)
            assert meta.alts.inside(runner.kv_cache) == inside
            assert fused.accepts(torch.tensor([1, 2, 3]), meta, runner.kv_cache) == (inside and cpu_kernels.available())
