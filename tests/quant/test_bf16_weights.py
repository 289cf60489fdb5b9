"""``--cpu-bf16-weights`` (``CpuOptions.bf16_weights``): a dense fp32 model's linears kept in bf16 and multiplied
in fp32 (``quant.store_bf16``, csrc/qgemm.c's bf16 rows). The engine serves the text of a dense fp32 model whose
weights are rounded to bf16; a model it does not apply to is refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.models import quant
from nxdserve.errors import ConfigError
from nxdserve.sampling_params import SamplingParams
from tests.helpers.engine import PROMPTS, make_core, run_to_completion, tokenize


def _greedy(core: object, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in run_to_completion(core, prompts, params)]  # type: ignore[arg-type]


def test_engine_serves_the_bf16_rounded_weights() -> None:
    core = make_core(dtype="float32", max_model_len=128, max_num_seqs=4, cpu=CpuOptions(bf16_weights=True))
    model = core.backend.model  # type: ignore[attr-defined]
    linears = [getattr(layer, attr) for layer in model.layers for attr in model.QUANTIZABLE]
    assert all(isinstance(w, quant.QuantLinear) and w.kind == "bf16" for w in linears)
    assert model.lm_head_quant is not None and model.lm_head_quant.kind == "bf16"
    # 2 bytes a weight where fp32 read 4
    assert linears[0].nbytes == linears[0].out_features * linears[0].in_features * 2
    prompts = tokenize(core, PROMPTS[:4])
    served = _greedy(core, prompts)

    reference = make_core(dtype="float32", max_model_len=128, max_num_seqs=4)
    dense = reference.backend.model  # type: ignore[attr-defined]
    with torch.no_grad():
        for layer in dense.layers:
            for attr in dense.QUANTIZABLE:
                weight = getattr(layer, attr)
                weight.copy_(weight.bfloat16().float())
        dense.lm_head_weight.copy_(dense.lm_head_weight.bfloat16().float())  # tied: the embedding too
    rounded = _greedy(reference, prompts)
    assert served == rounded
    assert all(len(tokens) == 12 for tokens in served)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [({"dtype": "bfloat16"}, "bfloat16"), ({"dtype": "float32", "quantization": "int8"}, "int8")],
)
def test_a_model_it_does_not_apply_to_is_refused(overrides: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=rf"--cpu-bf16-weights applies to a dense fp32 model.*{named}"):
        make_core(max_model_len=64, max_num_seqs=2, cpu=CpuOptions(bf16_weights=True), **overrides)


def test_without_the_kernels_it_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs the C kernels"):
        make_core(dtype="float32", max_model_len=64, max_num_seqs=2, cpu=CpuOptions(isa="none", bf16_weights=True))


def test_flag_reaches_the_cpu_options() -> None:
    from nxdserve.cli import build_parser, engine_config_from_args

    assert not CpuOptions().bf16_weights
    args = build_parser().parse_args(["--cpu-bf16-weights", "--dtype", "float32"])
    assert engine_config_from_args(args).cpu.bf16_weights
