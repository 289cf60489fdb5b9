"""bf16 weights on a CPU without native bf16 (``CpuOptions.bf16_weights``, on by default): with ``--dtype auto``
resolving to fp32 there, a dense model's linears and LM head are kept in bf16 and multiplied in fp32
(``quant.store_bf16``, csrc/qgemm.c's bf16 rows). The engine serves the text of the dense fp32 model whose weights
are rounded to bf16; an explicit ``--dtype float32``, ``--no-cpu-bf16-weights``, a CPU with native bf16 and
``--cpu-isa none`` keep dense weights. A forced ``--cpu-isa avx2`` stands for an AVX2-only CPU."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import torch

from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.core import EngineCore
from nxdserve.engine.models import cpu_build, quant
from nxdserve.sampling_params import SamplingParams
from tests.helpers.engine import make_core, run_to_completion
from tests.helpers.tiny_model import tiny_model_path

pytestmark = pytest.mark.skipif("avx2" not in cpu_build.runnable_paths(), reason="needs the avx2 kernel build")
PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 8], [4, 4, 6, 1, 9, 12, 30, 2], [17]]


def _core(**overrides: object) -> EngineCore:
    settings: dict[str, object] = {"model": str(_model()), "dtype": "auto", "max_model_len": 64, "max_num_seqs": 4}
    settings.update(overrides)
    return make_core(**settings)


@functools.cache
def _model() -> Path:
    return tiny_model_path("llama")


def _linears(core: EngineCore) -> list[object]:
    model = core.backend.model  # type: ignore[attr-defined]
    return [getattr(layer, attr) for layer in model.layers for attr in model.QUANTIZABLE] + [model.lm_head_quant]


def _greedy(core: EngineCore) -> list[list[int]]:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in run_to_completion(core, PROMPTS, params)]


def test_auto_dtype_without_native_bf16_serves_the_bf16_rounded_weights(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nxdserve.engine.backends.torch_backend"):
        core = _core(cpu=CpuOptions(isa="avx2"))
    assert "(weights: bf16, multiplied in fp32)" in caplog.text  # the start-up line says what is served
    assert core.backend.dtype == torch.float32  # type: ignore[attr-defined]
    linears = _linears(core)
    assert all(isinstance(w, quant.QuantLinear) and w.kind == "bf16" for w in linears)
    first = linears[0]
    assert isinstance(first, quant.QuantLinear) and first.nbytes == first.out_features * first.in_features * 2
    served = _greedy(core)

    reference = _core(dtype="float32", cpu=CpuOptions(isa="avx2"))
    dense = reference.backend.model  # type: ignore[attr-defined]
    with torch.no_grad():
        for layer in dense.layers:
            for attr in dense.QUANTIZABLE:
                weight = getattr(layer, attr)
                weight.copy_(weight.bfloat16().float())
        dense.lm_head_weight.copy_(dense.lm_head_weight.bfloat16().float())
    assert served == _greedy(reference)
    assert all(len(tokens) == 10 for tokens in served)


def test_a_prefill_above_the_kernel_rows_gives_the_dense_results() -> None:
    """Calls of more than kernel_rows() rows widen a transient fp32 copy: the same products to fp32 rounding,
    and no copy is kept on the weight."""
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    q = quant.store_bf16(weight)
    dense = weight.bfloat16().float()
    limit = quant.kernel_rows() or quant.KERNEL_ROWS
    for rows in (1, 5, quant.KERNEL_ROWS, limit, limit + 1, 200):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(q(x), x @ dense.t(), rtol=1e-5, atol=1e-4)
    assert "_cache" not in q.__dict__ or all(key == "kernel" for key in q.__dict__["_cache"])


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"dtype": "float32", "cpu": CpuOptions(isa="avx2")}, "an explicit --dtype float32 asks for dense fp32"),
        ({"cpu": CpuOptions(isa="avx2", bf16_weights=False)}, "--no-cpu-bf16-weights"),
        ({"cpu": CpuOptions(isa="none")}, "no C kernels to multiply them"),
    ],
)
def test_dense_weights_where_it_does_not_apply(overrides: dict[str, object], why: str) -> None:
    assert all(isinstance(w, torch.Tensor) or w is None for w in _linears(_core(**overrides))), why


def test_flag_reaches_the_cpu_options() -> None:
    from nxdserve.cli import build_parser, engine_config_from_args

    assert CpuOptions().bf16_weights
    args = build_parser().parse_args(["--no-cpu-bf16-weights"])
    assert not engine_config_from_args(args).cpu.bf16_weights
