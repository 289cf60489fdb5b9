"""4-bit groups over 32 calibrated at load (imatrix.py): the activation-weighted search, end to end on a tiny
model and against the plain search on synthetic weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nxdserve.engine.models import cpu_build, gptq, imatrix, qtune, quant
from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.errors import ConfigError
from tests.helpers.cpu_paths import forced_cpu_path
from tests.helpers.tiny_model import tiny_model_path


def _tiny() -> tuple[LlamaFamilyModel, object]:
    path = tiny_model_path("llama")
    return LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu")), path


@pytest.mark.parametrize("isa", ["none", "avx2"])
def test_weighted_search_fits_the_weights_large_inputs_multiply(isa: str) -> None:
    """Weighted by per-column importance, the search trades error on unimportant columns for the important ones:
    less weighted error than the plain search, in C and in torch alike."""
    if isa == "avx2" and "avx2" not in cpu_build.runnable_paths():
        pytest.skip("no AVX2")
    torch.manual_seed(0)
    weight = torch.randn(32, 256) * 0.05
    importance = torch.rand(256) ** 4 * 100 + 0.01  # a few columns matter most, as activations' mean squares do
    with forced_cpu_path(isa):
        plain = quant.quantize_int4(weight, 64)
        weighted = quant.quantize_int4(weight, 64, importance=importance, deltas=quant.IMATRIX_STEP_DELTAS)

    def weighted_error(q: quant.QuantLinear) -> float:
        return float(((q.dequantize() - weight).square() * importance).sum())

    assert weighted_error(weighted) < 0.9 * weighted_error(plain)


def test_weighted_search_in_c_matches_torch() -> None:
    torch.manual_seed(1)
    weight = torch.randn(24, 192) * 0.05
    importance = torch.rand(192) ** 4 * 100 + 0.01
    results = {}
    for isa in ("none", "generic"):
        with forced_cpu_path(isa):
            results[isa] = quant.quantize_int4(weight, 64, importance=importance, deltas=quant.IMATRIX_STEP_DELTAS)
    errors = {
        isa: ((q.dequantize() - weight).square() * importance).view(24, 3, 64).sum(2) for isa, q in results.items()
    }
    assert torch.all(errors["generic"] <= errors["none"] * (1 + 1e-4) + 1e-12)


def test_int4_groups_over_32_calibrate_at_load() -> None:
    model, path = _tiny()
    importance = imatrix.activation_importance(model, path)
    assert set(importance) == {f"layers.{i}.{a}" for i in range(2) for a in model.QUANTIZABLE}
    # The calibration forward leaves the dense weights in place.
    assert all(isinstance(getattr(layer, a), torch.nn.Parameter) for layer in model.layers for a in model.QUANTIZABLE)
    dense = {a: getattr(model.layers[0], a).detach().clone() for a in model.QUANTIZABLE}
    hidden_before = model.layers[0].qkv_weight.shape
    # lora=True: the weighted search alone, on the unscaled weights (awq.py's scales: tests/quant/test_awq.py).
    quant.quantize_model(model, "int4-g64", checkpoint=path, lora=True)
    for attr in model.QUANTIZABLE:
        q = getattr(model.layers[0], attr)
        assert type(q) is quant.QuantLinear and q.kind == "int4" and q.group == 64
        plain = quant.quantize_int4(dense[attr], 64)
        # The calibrated grid is not the plain one, and it fits the calibration's important columns better.
        imp = importance[f"layers.0.{attr}"]
        err = [float(((x.dequantize() - dense[attr]).square() * imp).sum()) for x in (q, plain)]
        assert err[0] <= err[1]
    assert model.layers[0].qkv_weight.shape == hidden_before
    assert model.lm_head_quant is not None and model.lm_head_quant.kind == "q8_0"  # an fp32 model's 4-bit head
    # The quantized model still runs.
    from nxdserve.engine.models.perplexity import next_token_logits

    logits = next_token_logits(model, list(range(5, 40)))
    assert logits.shape[0] == 35 and torch.isfinite(logits).all()


def test_calibration_needs_the_tokenizer() -> None:
    model, _ = _tiny()
    with pytest.raises(ConfigError, match="tokenizer"):
        quant.quantize_model(model, "int4-g128", checkpoint=None)
    # rtn (group 128, round-to-nearest) needs no calibration.
    quant.quantize_model(model, "rtn")
    assert model.layers[0].qkv_weight.group == 128


@pytest.mark.parametrize("text", (gptq.CALIBRATION, *qtune.TUNING_TEXTS), ids=lambda p: p.name)
def test_calibration_texts_are_not_the_evaluation_sample(text: Path) -> None:
    from nxdserve.engine.models.perplexity import SAMPLE

    calibration, sample = text.read_text(), SAMPLE.read_text()
    sentences = {s.strip() for s in sample.split(".") if len(s.strip()) > 20}
    assert len(sentences) > 10
    assert not any(s in calibration for s in sentences)


def _first_layer_inputs(model: LlamaFamilyModel, path: object) -> torch.Tensor:
    """Layer 0's q/k/v inputs over the calibration text: its input norm of the token embeddings (as the
    calibration forward computes them: rows of at most ``gptq.CALIBRATION_ROW`` tokens, no state between)."""
    ids = gptq.calibration_ids(path)
    row = min(gptq.CALIBRATION_ROW, model.max_len)
    rows = [ids[i : i + row] for i in range(0, len(ids), row)]
    kept = torch.tensor([t for r in ([r for r in rows if len(r) >= 16] or rows[:1]) for t in r])
    with torch.inference_mode():
        return model.layers[0].input_norm(torch.nn.functional.embedding(kept, model.embed_weight)).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_64_biases_cancel_the_mean_output_error_on_the_calibration(dtype: torch.dtype) -> None:
    """The dense layer 0's q/k/v mean output over the calibration text is the quantized one's (bias included);
    without the bias it is not. The model, which had no biases, gets one per linear in its own dtype, and runs."""
    path = tiny_model_path("llama")
    model = LlamaFamilyModel.from_pretrained(path, dtype, torch.device("cpu"))
    assert all(getattr(model.layers[0], b) is None for b in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias"))
    dense = model.layers[0].qkv_weight.detach().float().clone()
    x = _first_layer_inputs(model, path)
    quant.quantize_model(model, "int4-g64", checkpoint=path, lora=True)
    layer = model.layers[0]
    for name in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias"):
        bias = getattr(layer, name)
        assert bias is not None and bias.dtype == dtype and bias.is_contiguous()
    q = layer.qkv_weight.dequantize()
    want = (x @ dense.t()).mean(0)
    uncorrected = (x @ q.t()).mean(0)
    corrected = uncorrected + layer.qkv_bias.float()
    scale = float(want.abs().mean())
    assert float((uncorrected - want).abs().max()) > 1e-3 * scale  # the grid's mean error is there to cancel
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4  # the bias stored in bf16
    assert float((corrected - want).abs().max()) <= tol * max(scale, 1.0)
    from nxdserve.engine.models.perplexity import next_token_logits

    logits = next_token_logits(model, list(range(5, 40)))
    assert logits.shape[0] == 35 and torch.isfinite(logits).all()


@pytest.mark.parametrize(("method", "lora"), [("int4-g128", True), ("int4-g128", False), ("int4-g32", False)])
def test_other_groups_get_no_bias(method: str, lora: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also a bf16 model's calibration (with awq.py's scales where not ``lora``): its forward calls the stand-ins,
    where the fused bf16 forward would otherwise have read their dense copies (fused_decode.py); and one epoch of
    qtune.py's tuning of a bf16 model's group 128."""
    monkeypatch.setattr(qtune, "TUNING_TEXTS", qtune.TUNING_TEXTS[:1])  # the test's time
    path = tiny_model_path("llama")
    model = LlamaFamilyModel.from_pretrained(path, torch.bfloat16, torch.device("cpu"))
    quant.quantize_model(model, method, checkpoint=path, lora=lora, tune_epochs=0 if lora else 1)
    assert all(type(layer.qkv_weight) is quant.QuantLinear for layer in model.layers)
    assert all(layer.qkv_bias is None and layer.down_bias is None for layer in model.layers)


def test_correct_bias_adds_to_a_bias_the_model_has() -> None:
    model, _ = _tiny()
    layer = model.layers[0]
    n = layer.o_weight.shape[0]
    imatrix.correct_bias(layer, "o_weight", torch.full((n,), 0.5))
    imatrix.correct_bias(layer, "o_weight", torch.full((n,), 0.25))
    assert torch.equal(layer.o_bias, torch.full((n,), 0.75))
