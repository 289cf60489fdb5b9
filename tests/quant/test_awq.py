"""Activation-aware scaling for the 4-bit groups over 32 (awq.py): the folding is exact, the scaled codes have no
more calibration error than the activation-weighted search alone, LoRA-served models and tied embeddings are left
unscaled, and group 32 is unchanged."""

from __future__ import annotations

import pytest
import torch

from nxdserve.engine.models import awq, gptq, imatrix, quant
from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.engine.models.perplexity import next_token_logits
from tests.helpers.tiny_model import tiny_model_path

IDS = list(range(5, 45))


def _tiny(family: str = "llama") -> tuple[LlamaFamilyModel, object]:
    path = tiny_model_path(family)
    return LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu")), path


def _norms(model: LlamaFamilyModel) -> list[torch.Tensor]:
    return [n.weight.detach().clone() for layer in model.layers for n in (layer.input_norm, layer.post_norm)]


@pytest.mark.parametrize("family", ["llama", "llama-linear-bias", "llama-llama3-untied", "qwen3"])
def test_folded_scales_leave_the_dense_model_unchanged(family: str) -> None:
    """Scales folded into the norms, v's rows (GQA: one per v channel) and up's rows: the unquantized model's
    logits are the original's to fp32 rounding, though every scaled weight changed."""
    model, _ = _tiny(family)
    before = next_token_logits(model, IDS)
    embed = model.embed_weight.detach().clone()
    spec = model.spec
    generator = torch.Generator().manual_seed(0)

    def scales(n: int) -> torch.Tensor:
        return torch.rand(n, generator=generator) * 3 + 0.25

    originals = [{a: getattr(layer, a).detach().clone() for a in model.QUANTIZABLE} for layer in model.layers]
    for layer in model.layers:
        awq.fold_scales(
            layer,
            scales(spec.hidden_size),
            scales(spec.kv_size),
            scales(spec.hidden_size),
            scales(spec.intermediate_size),
        )
    for layer, original in zip(model.layers, originals, strict=True):
        for attr, weight in original.items():
            assert not torch.allclose(getattr(layer, attr), weight), attr
    after = next_token_logits(model, IDS)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.embed_weight, embed, rtol=0, atol=0)


def _output_errors(model: LlamaFamilyModel, dense: LlamaFamilyModel, path: object) -> float:
    """The quantized model's squared logit error against the dense model's on the calibration text."""
    ids = gptq.calibration_ids(path)[:120]
    return float((next_token_logits(model, ids) - next_token_logits(dense, ids)).square().mean())


@pytest.mark.parametrize("group", [64, 128])
def test_scaled_codes_have_no_more_calibration_error_than_the_weighted_search(group: int) -> None:
    """Per linear, the chosen scale's output error on the calibration inputs is at most alpha 0's (the
    activation-weighted search alone), and the model's logits on the calibration text are no further from the
    dense model's."""
    dense, path = _tiny()
    inputs = gptq.calibration_inputs(dense, path)
    layer = dense.layers[0]
    for attr in dense.QUANTIZABLE:
        c = inputs[f"layers.0.{attr}"]
        h = c.hessian()
        weight = getattr(layer, attr).detach()
        s, q, err = awq.scale_search(weight, c, group)
        plain = imatrix.weighted_int4(weight, group, c.mean_square)
        d = plain.dequantize() - weight
        assert err <= float(((d @ h) * d).sum()) * (1 + 1e-5)
        d = q.dequantize() / s - weight
        assert err == pytest.approx(float(((d @ h) * d).sum()), rel=1e-5)
    scaled, weighted = _tiny()[0], _tiny()[0]
    awq.quantize_model_awq(scaled, group, path)
    imatrix.quantize_model_imatrix(weighted, group, path)
    assert any(not torch.equal(a, b) for a, b in zip(_norms(scaled), _norms(dense), strict=True))
    assert _output_errors(scaled, dense, path) <= _output_errors(weighted, dense, path)


def test_lora_served_models_are_not_scaled() -> None:
    """An adapter reads a linear's original input: with LoRA the calibrated groups are the weighted search's
    alone, the norms untouched; without it the norms carry the folded scales. The embedding (tied to the head)
    and the final norm are never scaled."""
    model, path = _tiny()
    norms, final, embed = _norms(model), model.norm.weight.detach().clone(), model.embed_weight.detach().clone()
    reference = _tiny()[0]
    imatrix.quantize_model_imatrix(reference, 128, path)
    quant.quantize_model(model, "int4-g128", checkpoint=path, lora=True, tune_epochs=0)  # qtune: test_qtune.py
    assert all(torch.equal(a, b) for a, b in zip(_norms(model), norms, strict=True))
    for layer, ref in zip(model.layers, reference.layers, strict=True):
        for attr in model.QUANTIZABLE:
            torch.testing.assert_close(getattr(layer, attr).dequantize(), getattr(ref, attr).dequantize())
    served = _tiny()[0]
    quant.quantize_model(served, "int4-g128", checkpoint=path, tune_epochs=0)
    assert any(not torch.equal(a, b) for a, b in zip(_norms(served), norms, strict=True))
    unscaled = _tiny()[0]  # group 64 keeps the weighted search alone (awq.SCALED_GROUPS)
    quant.quantize_model(unscaled, "int4-g64", checkpoint=path)
    assert all(torch.equal(a, b) for a, b in zip(_norms(unscaled), norms, strict=True))
    for m in (model, served):
        # the tied head is never scaled; an fp32 model's is served from Q8_0 blocks of it (quant.lm_head_format)
        assert m.lm_head_weight is m.embed_weight
        assert m.lm_head_quant is not None and m.lm_head_quant.kind == "q8_0"
        torch.testing.assert_close(m.lm_head_quant.dequantize(), embed, rtol=0, atol=float(embed.abs().max()) / 200)
        torch.testing.assert_close(m.embed_weight, embed, rtol=0, atol=0)
        torch.testing.assert_close(m.norm.weight, final, rtol=0, atol=0)
    logits = next_token_logits(served, IDS)
    assert torch.isfinite(logits).all()
    # The folded norms are ordinary fp32 norm weights: the fused quantized decode takes the scaled model.
    assert served.fused_quant_decode.supported_model and served.fused_quant_decode._weights_supported()


def test_group_32_is_not_scaled() -> None:
    model, path = _tiny()
    norms = _norms(model)
    dense = {a: getattr(model.layers[1], a).detach().clone() for a in model.QUANTIZABLE}
    quant.quantize_model(model, "int4", checkpoint=path)
    assert all(torch.equal(a, b) for a, b in zip(_norms(model), norms, strict=True))
    for attr, weight in dense.items():
        expected = quant.quantize_int4(weight, 32)
        torch.testing.assert_close(getattr(model.layers[1], attr).dequantize(), expected.dequantize(), rtol=0, atol=0)
