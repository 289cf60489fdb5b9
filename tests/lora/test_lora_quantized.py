"""LoRA over quantized base weights (``QuantLinear``: what a .gguf model is served from by default, and the bf16
weights of a dense model on a CPU without native bf16): each adapter gives what the same adapter gives over a
dense model holding the quantized weights' values, so the adapters' GEMMs add to the quantized base exactly as to
a dense one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.core import EngineCore
from nxdserve.engine.models import cpu_build
from nxdserve.engine.models.quant import QuantLinear
from nxdserve.lora.request import LoRARequest
from nxdserve.sampling_params import OutputKind, SamplingParams
from tests.helpers.engine import make_core
from tests.helpers.lora import make_peft_adapter
from tests.helpers.tiny_model import single_torch_thread, tiny_model_path

PROMPTS = [[1, 450, 7483, 310, 3444, 338], [1, 22172, 29892, 590, 1024, 338, 100, 200, 300]]



def _core(adapters: dict[str, Path], **overrides: object) -> EngineCore:
    core = make_core(model=str(tiny_model_path("llama")), enable_lora=True, max_loras=2, max_lora_rank=8,
                     max_num_seqs=4, max_model_len=64, **overrides)
    for i, (name, path) in enumerate(adapters.items(), start=1):
        core.lora.load(LoRARequest(name, i, str(path)))
    return core


def _greedy(core: EngineCore, name: str | None) -> list[list[int]]:
    ids = []
    for prompt in PROMPTS:
        p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
        request = core.make_request(prompt, p, lora=None if name is None else core.lora.resolve(name))
        core.add_request(request)
        ids.append(request.request_id)
    finals = {}
    while core.has_unfinished:
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
    return [list(finals[i].outputs[0].token_ids) for i in ids]


# The base formats: int4 (its fp32 model's head as Q8_0), and the bf16 weights --dtype auto serves a dense model
# on a CPU without native bf16 (a forced AVX2 build stands for one).
BASES = {
    "int4": ({"quantization": "int4"}, "q8_0"),
    "bf16-weights": ({"dtype": "auto", "cpu": CpuOptions(isa="avx2")}, "bf16"),
}


@pytest.mark.parametrize("base_format", list(BASES))
def test_adapters_over_quantized_base_weights(tmp_path: Path, exact_kernels: None, base_format: str) -> None:
    overrides, head_kind = BASES[base_format]
    if "cpu" in overrides and "avx2" not in cpu_build.runnable_paths():
        pytest.skip("needs the avx2 kernel build")
    base = tiny_model_path("llama")
    adapters = {"all": make_peft_adapter(base, tmp_path / "all", seed=1),
                "mlp": make_peft_adapter(base, tmp_path / "mlp", targets=("gate_proj", "down_proj"), seed=3)}
    with single_torch_thread():
        quantized = _core(adapters, **overrides)
        reference = _core(adapters)
        # The reference: dense, holding exactly the values the 4-bit codes stand for.
        model, dense_model = quantized.backend.model, reference.backend.model  # type: ignore[attr-defined]
        with torch.no_grad():
            for layer, dense_layer in zip(model.layers, dense_model.layers, strict=True):
                for name in model.QUANTIZABLE:
                    weight = getattr(layer, name)
                    assert isinstance(weight, QuantLinear)
                    getattr(dense_layer, name).copy_(weight.dequantize(torch.float32))
            head = model.lm_head_quant  # the 4-bit methods' Q8_0 head of an fp32 model (quant.lm_head_format)
            assert head is not None and head.kind == head_kind
            dense_model.lm_head_weight = torch.nn.Parameter(head.dequantize(torch.float32), requires_grad=False)
        got = {name: _greedy(quantized, name) for name in [None, *adapters]}
        assert got == {name: _greedy(reference, name) for name in [None, *adapters]}
    assert len({tuple(v[0]) for v in got.values()}) == len(got)  # each adapter changes the output
