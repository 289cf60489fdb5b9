"""End-to-end tuning of 4-bit group scales and offsets (qtune.py): its forward is the served one, its loss is a
KL, tuning lowers that KL with the codes fixed, and the served model computes with the tuned scales."""

from __future__ import annotations

import pytest
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.torch_backend import TorchBackend
from nxdserve.engine.models import qtune, quant
from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.engine.models.perplexity import next_token_logits
from nxdserve.errors import ConfigError
from tests.helpers.tiny_model import tiny_model_path

IDS = list(range(5, 45))


def _tiny(family: str = "llama") -> tuple[LlamaFamilyModel, object]:
    path = tiny_model_path(family)
    return LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu")), path


def _weights(model: LlamaFamilyModel) -> list[dict[str, torch.Tensor]]:
    def dense(w: object) -> torch.Tensor:
        return w.dequantize() if isinstance(w, quant.QuantLinear) else w.detach().float()  # type: ignore[union-attr]

    return [{a: dense(getattr(layer, a)) for a in model.QUANTIZABLE} for layer in model.layers]


FAMILIES = ["llama", "llama-linear-bias", "llama-llama3-untied", "qwen2", "qwen3", "mistral-window"]


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_forward_is_the_served_forward(family: str) -> None:
    """Biases, q/k norms, untied heads, Llama 3 RoPE scaling, sliding windows (5-6 tokens, shorter than the row):
    the training forward gives the served logits."""
    model, _ = _tiny(family)
    reference = qtune.reference_logits(model, qtune._Frozen(model), torch.tensor(IDS), _weights(model))
    served = next_token_logits(model, IDS)
    assert torch.allclose(reference, served, atol=2e-4, rtol=1e-4), float((reference - served).abs().max())


def test_collapsed_kl_is_zero_at_the_teacher_and_bounds_the_full_kl() -> None:
    torch.manual_seed(0)
    teacher, student = torch.randn(7, 50) * 3, torch.randn(7, 50) * 3
    teacher_lp = torch.log_softmax(teacher, -1)
    student_lp = torch.log_softmax(student, -1)
    full = float(torch.nn.functional.kl_div(student_lp, teacher_lp, log_target=True, reduction="sum"))

    def collapsed(k: int, logits: torch.Tensor) -> float:
        top = teacher_lp.topk(k, dim=-1)
        return float(qtune.collapsed_kl(logits, top.values, top.indices))

    assert abs(collapsed(8, teacher)) < 1e-5
    assert collapsed(50, student) == pytest.approx(full, rel=1e-4)  # every class kept: the full KL
    assert 0 < collapsed(8, student) < full


def test_tuning_lowers_the_kl_with_the_codes_fixed_and_the_model_serves_the_tuned_scales() -> None:
    model, path = _tiny()
    targets = qtune.teacher_targets(model, path)
    assert targets.tokens > 5000 and all(len(r) <= qtune.CHUNK for r in targets.rows)
    assert all(lp.shape == (len(r), qtune.TOP_K) for r, lp in zip(targets.rows, targets.logprobs, strict=True))
    targets = qtune.Targets(targets.rows[:8], targets.logprobs[:8], targets.indices[:8])  # the test's time
    quant.quantize_model(model, "int4-g128", checkpoint=path, tune_epochs=0)  # type: ignore[arg-type]
    codes = {a: getattr(model.layers[0], a).codes().clone() for a in model.QUANTIZABLE}
    scales = model.layers[0].qkv_weight.scales.clone()

    def kl() -> float:
        frozen, weights = qtune._Frozen(model), _weights(model)
        with torch.no_grad():
            total = sum(
                float(qtune.collapsed_kl(qtune.reference_logits(model, frozen, row, weights), lp, ix))
                for row, lp, ix in zip(targets.rows, targets.logprobs, targets.indices, strict=True)
            )
        return total / targets.tokens

    before = kl()
    first, last = qtune.tune_scales(model, targets, epochs=6, lr=3e-3)
    after = kl()
    assert after < 0.9 * before, (before, after)
    assert last < first
    layer = model.layers[0]
    assert all(torch.equal(getattr(layer, a).codes(), codes[a]) for a in model.QUANTIZABLE)
    assert not torch.equal(layer.qkv_weight.scales, scales)
    # The stored per-32 scales repeat each group's (group 128: 4 equal columns a group).
    assert torch.equal(layer.qkv_weight.scales[:, 0], layer.qkv_weight.scales[:, 1])
    served = next_token_logits(model, IDS)
    reference = qtune.reference_logits(model, qtune._Frozen(model), torch.tensor(IDS), _weights(model))
    assert torch.allclose(served, reference, atol=2e-4, rtol=1e-4)


def test_quantize_model_tunes_the_groups_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``int4-g128`` is tuned at load; with ``tune_epochs=0``, and at the other groups, nothing is tuned. Tuned
    and untuned differ only in scales and offsets."""
    monkeypatch.setattr(qtune, "EPOCHS", 1)
    monkeypatch.setattr(qtune, "TUNING_TEXTS", qtune.TUNING_TEXTS[:1])  # the test's time
    monkeypatch.setattr(qtune, "LEARNING_RATE", 2e-3)
    runs: list[int] = []
    tune = qtune.tune_scales
    monkeypatch.setattr(qtune, "tune_scales", lambda *a, **k: runs.append(1) or tune(*a, **k))
    tuned, path = _tiny()
    untuned, _ = _tiny()
    quant.quantize_model(tuned, "int4-g128", checkpoint=path)  # type: ignore[arg-type]
    quant.quantize_model(untuned, "int4-g128", checkpoint=path, tune_epochs=0)  # type: ignore[arg-type]
    assert runs == [1] and qtune.TUNED_GROUPS == (128,)
    a, b = tuned.layers[1].down_weight, untuned.layers[1].down_weight
    assert torch.equal(a.codes(), b.codes()) and not torch.equal(a.offsets, b.offsets)
    quant.quantize_model(_tiny()[0], "int4-g64", checkpoint=path)  # type: ignore[arg-type]
    assert runs == [1]


def test_only_the_plain_decoder_is_tuned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A subclass (Mllama's decoder is one: cross-attention layers the tuning forward does not model) is quantized
    without tuning, and says so."""

    class CrossDecoder(LlamaFamilyModel):
        pass

    model, path = _tiny()
    assert qtune.supports(model)
    model.__class__ = CrossDecoder
    assert not qtune.supports(model)
    monkeypatch.setattr(qtune, "teacher_targets", lambda *a, **k: pytest.fail("tuned"))
    quant.quantize_model(model, "int4-g128", checkpoint=path)  # type: ignore[arg-type]
    assert isinstance(model.layers[0].qkv_weight, quant.QuantLinear)


def test_tuning_refuses_a_model_with_dense_linears(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qtune, "TUNING_TEXTS", qtune.TUNING_TEXTS[:1])  # the test's time
    model, path = _tiny()
    targets = qtune.teacher_targets(model, path, top_k=4)
    assert all(ix.shape == (len(r), 4) for r, ix in zip(targets.rows, targets.indices, strict=True))
    with pytest.raises(TypeError, match="4-bit"):
        qtune.tune_scales(model, targets, epochs=1)


@pytest.mark.parametrize("epochs", [None, 0, 2])
def test_backend_tunes_as_configured(epochs: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--quantization-tune-epochs`` reaches the tuning through the torch backend: default ``qtune.EPOCHS``, 0
    none; a negative count is refused."""
    calls: list[int] = []
    monkeypatch.setattr(qtune, "TUNING_TEXTS", qtune.TUNING_TEXTS[:1])  # the test's time
    tune = qtune.tune_scales
    monkeypatch.setattr(qtune, "tune_scales", lambda m, t, e=None, lr=None: calls.append(e) or tune(m, t, 1, lr))
    path = tiny_model_path("llama")
    config = EngineConfig(
        model=str(path), backend="torch", dtype="float32", max_model_len=64, max_num_seqs=2, quantization="int4-g128",
        quantization_tune_epochs=epochs,
    ).resolve(model_max_positions=512)  # fmt: skip
    TorchBackend(path, config)
    assert calls == ([] if epochs == 0 else [epochs or qtune.EPOCHS])
    with pytest.raises(ConfigError, match="quantization-tune-epochs"):
        EngineConfig(model=str(path), quantization_tune_epochs=-1).resolve(model_max_positions=512)
    with pytest.raises(ConfigError, match="int4-g128 only, not 'int8'"):  # no silent no-op with other methods
        EngineConfig(model=str(path), quantization="int8", quantization_tune_epochs=1).resolve(512)
