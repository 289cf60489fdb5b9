"""The quantizers' scale searches in C (csrc/qsearch.c) against the torch ones (quant.py), on each forced kernel
path. The candidates and the arithmetic are torch's, but the sums run in another order: int4's least-squares fits
land a few ulps away, and where two candidates' errors nearly tie either may win. So the contract is the error:
per group never more than fp32 rounding worse than torch's choice, and the same in total."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nxdserve.engine.models import cpu_build, cpu_weight_kernels, quant
from tests.helpers.cpu_paths import forced_cpu_path

PATHS = [p for p in ("generic", "avx2") if p in cpu_build.runnable_paths()]
pytestmark = pytest.mark.skipif(not PATHS or cpu_build.compiler() is None, reason="no C kernels on this machine")


def _weight(rows: int = 48, cols: int = 320) -> torch.Tensor:
    """Normal weights with a few outlier columns and one all-equal row (its groups' span is 0)."""
    torch.manual_seed(3)
    weight = torch.randn(rows, cols) * 0.05
    weight[:, ::37] *= 8
    weight[5] = 0.25
    return weight


def _int4_error(weight: torch.Tensor, group: int, q: quant.QuantLinear) -> torch.Tensor:
    """Squared error per group of ``q``'s weights against ``weight``."""
    n, k = weight.shape
    padded = -(-k // group) * group
    diff = F.pad(q.dequantize() - weight, (0, padded - k))
    return diff.view(n, padded // group, group).square().sum(2)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("group", quant.INT4_GROUPS)
def test_int4_search_in_c_matches_torch(isa: str, group: int) -> None:
    weight = _weight()
    with forced_cpu_path("none"):
        reference = quant.quantize_int4(weight, group)
    with forced_cpu_path(isa):
        fast = quant.quantize_int4(weight, group)
    assert fast.data.shape == reference.data.shape and fast.scales.shape == reference.scales.shape
    ref_err, fast_err = _int4_error(weight, group, reference), _int4_error(weight, group, fast)
    # Per group at most fp32 rounding worse (measured <= 3e-6 relative), and the same in total.
    assert torch.all(fast_err <= ref_err * (1 + 2e-5) + 1e-12), float(((fast_err - ref_err) / ref_err).max())
    assert float(fast_err.sum()) == pytest.approx(float(ref_err.sum()), rel=1e-6)
    # The scales differ by a few ulps where they differ at all (row 5 aside: its exact fits tie at zero error).
    rows = [r for r in range(weight.shape[0]) if r != 5]
    torch.testing.assert_close(fast.scales[rows], reference.scales[rows], rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(fast.offsets[rows], reference.offsets[rows], rtol=1e-4, atol=1e-6)
    # The all-equal row: every code 0 and the value exact, as torch's.
    torch.testing.assert_close(fast.dequantize()[5], weight[5], rtol=0, atol=1e-6)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("cols", [320, 200])  # 200: 32 does not divide it, one scale per row
def test_fp8_search_in_c_matches_torch(isa: str, cols: int) -> None:
    weight = _weight(cols=cols)
    with forced_cpu_path("none"):
        reference = quant.quantize_fp8(weight)
    with forced_cpu_path(isa):
        fast = quant.quantize_fp8(weight)
    assert fast.group == reference.group == (32 if cols % 32 == 0 else 0)
    # The same candidates bit for bit (base and multipliers as torch computes them): nearly every scale equal,
    # the rest near ties, whose error is within rounding of torch's choice.
    same = fast.scales == reference.scales
    assert float(same.float().mean()) >= 0.99
    group = fast.group or cols
    ref_err, fast_err = ((q.dequantize() - weight).view(weight.shape[0], -1, group).square().sum(2)
                         for q in (reference, fast))  # fmt: skip
    assert torch.all(fast_err <= ref_err * (1 + 1e-5) + 1e-12)
    same_codes = same.view(weight.shape[0], -1, 1).expand(-1, -1, group).reshape(weight.shape)
    assert torch.equal(fast.data.view(torch.uint8)[same_codes], reference.data.view(torch.uint8)[same_codes])


@pytest.mark.parametrize("isa", PATHS)
def test_search_rejects_what_it_cannot_take(isa: str) -> None:
    with forced_cpu_path(isa):
        with pytest.raises(ValueError, match="multiple of group"):
            cpu_weight_kernels.quant_search(torch.zeros(4, 100), 32, [15.0], "int4")
        with pytest.raises(ValueError, match="int4 groups <= 128"):
            cpu_weight_kernels.quant_search(torch.zeros(4, 256), 256, [15.0], "int4")


def _calibration(cols: int, tokens: int, seed: int) -> torch.Tensor:
    """Inputs with correlated channels and a few large ones, as a linear's activations are."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=gen) * 0.1 + torch.eye(cols)
    x = torch.randn(tokens, cols, generator=gen) @ mix
    x[:, ::29] *= 6
    return x


@pytest.mark.parametrize("group", [64, 128])
def test_gptq_lowers_the_output_error_on_its_calibration_inputs(group: int) -> None:
    from nxdserve.engine.models import gptq

    weight = _weight(rows=64, cols=320)
    x = _calibration(320, 2000, seed=0)
    calib, held_out = x[:1000], x[1000:]  # calibrated on one half, checked on the other too
    with forced_cpu_path(PATHS[-1]):
        searched = quant.quantize_int4(weight, group)
        compensated = gptq.gptq_int4(weight, calib.t() @ calib, group)
    assert compensated.kind == "int4" and compensated.data.shape == searched.data.shape

    def output_error(q: quant.QuantLinear, inputs: torch.Tensor) -> float:
        return float((inputs @ (q.dequantize() - weight).t()).square().sum())

    assert output_error(compensated, calib) < 0.7 * output_error(searched, calib)
    assert output_error(compensated, held_out) < 0.9 * output_error(searched, held_out)


@pytest.mark.parametrize("isa", PATHS)
def test_gptq_loop_in_c_matches_torch(isa: str) -> None:
    """The column loop in C (csrc/qsearch.c) against gptq.py's torch loop: the error feedback carries rounding
    differences on, so a few codes differ; the output error stays the same to a fraction of a percent."""
    from nxdserve.engine.models import gptq

    weight = _weight(rows=40, cols=200)  # 200: padded to the group
    x = _calibration(200, 600, seed=1)
    hessian = x.t() @ x
    with forced_cpu_path("none"):
        reference = gptq.gptq_int4(weight, hessian, 64)
    with forced_cpu_path(isa):
        fast = gptq.gptq_int4(weight, hessian, 64)
    assert float((fast.data == reference.data).float().mean()) > 0.95
    errors = [float((x @ (q.dequantize() - weight).t()).square().sum()) for q in (reference, fast)]
    assert errors[1] == pytest.approx(errors[0], rel=5e-3)
