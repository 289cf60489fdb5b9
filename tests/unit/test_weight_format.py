"""The torch backend's default weight format (engine/backends/weight_format.py): a .gguf model is served from
its own 4-bit blocks unless --dtype or --quantization says otherwise, or the machine's measured-fast path
reads dense weights. The rule cheaply, case by case; then the default model loaded both ways."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.weight_format import FUSED_BF16_PATHS, default_weight_format
from nxdserve.engine.models.device import cpu_has_fast_bf16
from nxdserve.engine.models.quant import QuantLinear
from nxdserve.sampling_params import SamplingParams
from tests.helpers.engine import make_core, run_to_completion

GGUF = Path("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _choose(gguf: Path | None = GGUF, device: torch.device = CPU, dtype: torch.dtype = torch.float32,
            kernel_path: str = "avx2", multimodal: bool = False, **config: object) -> str | None:
    chosen = default_weight_format(EngineConfig(**config), gguf, device, dtype, kernel_path, multimodal)  # type: ignore[arg-type]
    assert chosen.reason
    return chosen.quantization


def test_a_gguf_model_on_a_cpu_is_served_from_its_blocks_by_default() -> None:
    chosen = default_weight_format(EngineConfig(), GGUF, CPU, torch.float32, "avx2", False)
    assert (chosen.quantization, chosen.by_default) == ("gguf", True)
    assert "--dtype float32" in chosen.reason  # the log line says how to get a dense copy
    for path in ("generic", "neon", "none", "avx2"):
        assert _choose(kernel_path=path) == "gguf", path
    # A bf16 default with the C kernels forced below the fused decoder's (--cpu-isa avx2 on AVX512-BF16).
    assert _choose(dtype=torch.bfloat16, kernel_path="avx2") == "gguf"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_asks_for_a_dense_copy(dtype: str) -> None:
    chosen = default_weight_format(EngineConfig(dtype=dtype), GGUF, CPU, torch.float32, "avx2", False)
    assert (chosen.quantization, chosen.by_default) == (None, False)


def test_an_explicit_quantization_wins() -> None:
    for method in ("int8", "int4", "gguf"):
        chosen = default_weight_format(EngineConfig(quantization=method), GGUF, CPU, torch.float32, "avx2", False)
        assert (chosen.quantization, chosen.by_default) == (method, False)
    # with a dtype too: the dense copy is then quantized as asked
    assert _choose(quantization="int8", dtype="bfloat16") == "int8"


def test_dense_where_the_blocks_are_not_the_default() -> None:
    assert _choose(gguf=None) is None  # a HF folder or hub id: unchanged
    assert _choose(multimodal=True) is None
    assert _choose(device=CUDA, dtype=torch.bfloat16, kernel_path="none") is None
    for path in ("avx512bf16", "amx"):  # the fused bf16 decoder reads dense bf16 weights
        assert _choose(dtype=torch.bfloat16, kernel_path=path) is None


def test_lora_and_speculative_keep_the_blocks() -> None:
    assert _choose(enable_lora=True) == "gguf"
    spec = {"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 2}
    assert _choose(speculative_config=spec) == "gguf"


def test_default_model_loads_its_blocks_and_float32_loads_dense(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nxdserve.engine.backends.torch_backend"):
        core = make_core(dtype="auto", max_model_len=64, max_num_seqs=2)
    backend = core.backend
    fused_bf16 = cpu_has_fast_bf16() and backend.kernel_path in FUSED_BF16_PATHS  # type: ignore[attr-defined]
    names = backend.model.QUANTIZABLE  # type: ignore[attr-defined]
    layers = backend.model.layers  # type: ignore[attr-defined]
    if fused_bf16:  # an AVX512-BF16 / AMX CPU keeps its fused dense bf16 decoder
        assert core.config.quantization is None
    else:
        assert core.config.quantization == "gguf"
        assert all(isinstance(getattr(layer, name), QuantLinear) for layer in layers for name in names)
        assert "--quantization gguf by default" in caplog.text and "--dtype float32" in caplog.text
    (out,) = run_to_completion(core, [[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4
    dense = make_core(dtype="float32", max_model_len=64, max_num_seqs=2)
    assert dense.config.quantization is None
    for layer in dense.backend.model.layers:  # type: ignore[attr-defined]
        for name in names:
            weight = getattr(layer, name)
            assert isinstance(weight, torch.Tensor) and weight.dtype == torch.float32


def test_forcing_the_avx2_kernels_serves_what_an_avx2_machine_would() -> None:
    """``--cpu-isa avx2`` on any x86 CPU that runs it: the default model in fp32 from its 4-bit blocks, with the
    KV cache sized for fp32, as on a CPU without native bf16."""
    from nxdserve.cpu_options import CpuOptions
    from nxdserve.engine.models import cpu_build

    if "avx2" not in cpu_build.runnable_paths():
        pytest.skip("this CPU cannot run the AVX2 kernels")
    try:
        core = make_core(dtype="auto", max_model_len=64, max_num_seqs=2, cpu=CpuOptions(isa="avx2"))
        backend = core.backend
        assert backend.dtype == torch.float32  # type: ignore[attr-defined]
        assert core.config.quantization == "gguf"
        assert backend.runner.kv_cache.data.dtype == torch.float32  # type: ignore[attr-defined]
        (out,) = run_to_completion(core, [[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 3
    finally:
        from nxdserve.engine.models import cpu_setup

        cpu_setup.apply(CpuOptions())


@pytest.mark.parametrize("isa", ["auto", "avx2"])
def test_a_gguf_whose_linears_are_not_served_quantized_falls_back_to_dense(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, isa: str
) -> None:
    """By default a file whose linears are in a type the blocks path does not take (here: the reader's own error
    for Q6_K) is served dense, with the reason logged; asked for with --quantization gguf, it is the error. With
    the AVX2 kernels forced, on any x86 CPU, the dense weights take the form a CPU without native bf16 gives."""
    from nxdserve.cpu_options import CpuOptions
    from nxdserve.engine.backends import torch_backend, weight_format
    from nxdserve.engine.models import cpu_build, cpu_setup, gguf_weights
    from nxdserve.errors import ConfigError
    from tests.helpers.tiny_model import tiny_model_path

    if isa == "avx2" and "avx2" not in cpu_build.runnable_paths():
        pytest.skip("this CPU cannot run the AVX2 kernels")

    def unserved(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, QuantLinear]:
        raise ConfigError("--quantization gguf: blk.0.ffn_down.weight is Q6_K; served quantized: Q4_0, Q4_1, Q4_K")

    monkeypatch.setattr(torch_backend, "_gguf_file", lambda config: Path("/m/tiny.Q4_K_M.gguf"))
    # The blocks are the default on every CPU here (on AVX512-BF16 / AMX the default is otherwise dense bf16).
    monkeypatch.setattr(weight_format, "FUSED_BF16_PATHS", ())
    monkeypatch.setattr(gguf_weights, "load_quantized_linears", unserved)
    settings = {"model": str(tiny_model_path("llama")), "max_model_len": 64, "max_num_seqs": 2,
                "cpu": CpuOptions(isa=isa)}
    try:
        with caplog.at_level(logging.INFO, logger="nxdserve.engine.backends.torch_backend"):
            core = make_core(dtype="auto", **settings)
        assert core.config.quantization is None
        assert "not the file's blocks" in caplog.text and "Q6_K" in caplog.text
        qkv = core.backend.model.layers[0].qkv_weight  # type: ignore[attr-defined]
        # Dense, never 4-bit codes: a tensor where bf16 is native; on a CPU without it (AVX2, NEON, or the AVX2
        # kernels forced) the weights kept in bf16 and multiplied in fp32 (--cpu-bf16-weights, the default there).
        if isa == "avx2":
            assert isinstance(qkv, QuantLinear) and qkv.kind == "bf16", qkv
        else:
            assert isinstance(qkv, torch.Tensor) or qkv.kind == "bf16", qkv
        with pytest.raises(ConfigError, match="Q6_K"):
            make_core(dtype="float32", quantization="gguf", **settings)
    finally:
        cpu_setup.apply(CpuOptions())
