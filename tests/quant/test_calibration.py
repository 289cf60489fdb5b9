"""The calibration statistics (gptq.CalibrationInputs): X^T X is kept in the smaller of its two forms (X itself
while there are no more tokens than inputs), both forms give the same Hessian and output errors, and the
activation-weighted search alone keeps neither."""

from __future__ import annotations

import pytest
import torch

from nxdserve.engine.models import awq, gptq
from nxdserve.engine.models.llama import LlamaFamilyModel
from tests.helpers.tiny_model import tiny_model_path


def _stand_in(k: int, keep_inputs: bool = True) -> gptq._Calibrating:
    dense = torch.randn(8, k, generator=torch.Generator().manual_seed(1))
    return gptq._Calibrating("int4", 8, k, torch.empty(0), torch.empty(0), dense=dense, keep_inputs=keep_inputs)


def _chunks(k: int, sizes: list[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=generator) * torch.linspace(0.1, 3, k) for n in sizes]


def test_inputs_are_kept_as_rows_until_they_outnumber_the_columns_then_as_their_gram() -> None:
    k = 48
    chunks = _chunks(k, [20, 20, 8, 30])
    standin = _stand_in(k)
    for i, chunk in enumerate(chunks):
        out = standin(chunk)
        torch.testing.assert_close(out, chunk @ standin.dense.t())  # type: ignore[union-attr]
        seen = torch.cat(chunks[: i + 1])
        inputs = standin.inputs()
        assert inputs.tokens == seen.shape[0]
        if seen.shape[0] <= k:  # X is no larger than X^T X: X itself, exactly
            assert inputs.gram is None and inputs.rows is not None
            torch.testing.assert_close(inputs.rows, seen, rtol=0, atol=0)
        else:
            assert inputs.rows is None and inputs.gram is not None and inputs.gram.shape == (k, k)
        torch.testing.assert_close(inputs.hessian(), seen.t() @ seen, rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(inputs.mean, seen.mean(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(inputs.mean_square, seen.square().mean(0), rtol=1e-5, atol=1e-6)


def test_both_forms_give_the_same_output_error_and_scale_choice() -> None:
    k, tokens = 96, 64
    (x,) = _chunks(k, [tokens])
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(40, k, generator=generator)
    delta = torch.randn(40, k, generator=generator) * 0.01
    stats = {"mean": x.mean(0), "mean_square": x.square().mean(0), "tokens": tokens}
    as_rows = gptq.CalibrationInputs(**stats, rows=x)  # type: ignore[arg-type]
    as_gram = gptq.CalibrationInputs(**stats, gram=x.t() @ x)  # type: ignore[arg-type]
    want = float((delta @ x.t()).square().sum())
    assert as_rows.output_error(delta) == pytest.approx(want, rel=1e-5)
    assert as_gram.output_error(delta) == pytest.approx(want, rel=1e-4)
    s_rows, q_rows, err_rows = awq.scale_search(weight, as_rows, 32)
    s_gram, q_gram, err_gram = awq.scale_search(weight, as_gram, 32)
    torch.testing.assert_close(s_rows, s_gram)
    torch.testing.assert_close(q_rows.dequantize(), q_gram.dequantize())
    assert err_rows == pytest.approx(err_gram, rel=1e-4)


def test_statistics_alone_keep_no_inputs() -> None:
    k = 32
    standin = _stand_in(k, keep_inputs=False)
    for chunk in _chunks(k, [10, 40]):
        standin(chunk)
    inputs = standin.inputs()
    assert inputs.rows is None and inputs.gram is None and inputs.tokens == 50
    with pytest.raises(ValueError, match="kept no inputs"):
        inputs.hessian()


def test_a_model_calibration_without_inputs_keeps_only_per_channel_statistics() -> None:
    path = tiny_model_path("llama")
    model = LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu"))
    full = gptq.calibration_inputs(model, path)
    light = gptq.calibration_inputs(model, path, keep_inputs=False)
    assert full.keys() == light.keys() and len(full) == 4 * len(model.layers)
    for name, c in light.items():
        assert c.gram is None and c.rows is None
        torch.testing.assert_close(c.mean_square, full[name].hessian().diagonal() / c.tokens, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(c.mean, full[name].mean)


def test_an_uncalled_stand_in_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="not called"):
        _stand_in(16).inputs()
