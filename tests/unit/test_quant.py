"""Quantized linears (engine/models/quant.py, gguf_weights.py): kernels, GGUF blocks, models, accuracy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.models import quant
from nxdserve.engine.models.gguf_weights import decode_4bit, decode_q8_0
from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.engine.models.perplexity import next_token_logits
from nxdserve.errors import ConfigError
from tests.helpers.tiny_model import tiny_model_path


@pytest.mark.parametrize("method", ["int8", "fp8", "int4-g32", "int4-g64", "int4-g128", "rtn"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_kernel_computes_its_own_dequantized_weight(method: str, act: torch.dtype) -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 200) * 0.1  # K=200: not a multiple of 64 / 128, so the 4-bit codes are padded
    q = quant.quantize(weight, method)
    dense = q.dequantize()
    assert dense.shape == weight.shape
    # Round-to-nearest error bounds of each format.
    err = (dense - weight).abs()
    if method == "int8":
        assert torch.all(err <= weight.abs().amax(1, keepdim=True) / 127 * 0.5001)
    elif method == "fp8":
        assert torch.all(err <= weight.abs() * 2.0**-4 + 1e-6)
    elif method == "rtn":
        assert float(err.max()) <= float((weight.amax() - weight.amin()) / 15 * 0.51)
    else:  # the scale search may clip a group's extremes, for less squared error than round-to-nearest
        rtn = quant.quantize_int4(weight, quant.METHODS[method][1], search=False).dequantize()
        assert float(err.square().sum()) < float((rtn - weight).square().sum())
    x = torch.randn(5, 200).to(act)
    out = q(x)
    assert out.dtype == act and out.shape == (5, 96)
    expected = x.to(quant.kernel_dtype or act).float() @ dense.t()
    tol = 2e-2 if torch.bfloat16 in (act, quant.kernel_dtype) else 1e-4
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def _gguf_roundtrip(kind: str, cols: int) -> tuple[np.ndarray, np.ndarray]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((8, cols)) * 0.2).astype(np.float32)
    qtype = getattr(GGMLQuantizationType, kind)
    raw = quantize(weight, qtype)
    return raw, dequantize(raw, qtype)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_to_the_gguf_packages_values(kind: str) -> None:
    raw, reference = _gguf_roundtrip(kind, 256)
    if kind == "Q8_0":
        q = decode_q8_0(raw, 256)
    else:
        codes, scale, offset = decode_4bit(kind, raw, 256)
        assert int(codes.min()) >= 0 and int(codes.max()) <= 15
        q = quant.int4_from_codes(codes, scale, offset, 32, 256)
    torch.testing.assert_close(q.dequantize(), torch.from_numpy(reference), rtol=1e-6, atol=1e-6)


def test_gguf_q4_k_blocks_decode_to_the_gguf_packages_values() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, size=(4, 2 * 144), dtype=np.uint8)  # any bytes are valid Q4_K blocks
    raw[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite d / dmin
    raw[:, 2:4] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)
    raw[:, 144:146], raw[:, 146:148] = raw[:, 0:2], raw[:, 2:4]
    reference = dequantize(raw, GGMLQuantizationType.Q4_K)
    q = quant.int4_from_codes(*decode_4bit("Q4_K", raw, 512), 32, 512)
    torch.testing.assert_close(q.dequantize(), torch.from_numpy(reference), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["int8", "fp8", "int4", "rtn"])
def test_tiny_model_quantized_computes_its_dequantized_weights(method: str, exact_kernels: None) -> None:
    path = tiny_model_path("llama")
    dense = LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu"), max_len=64)
    model = LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu"), max_len=64)
    quant.quantize_model(model, method)
    head = model.lm_head_quant
    if method == "int4":  # the 4-bit methods store an fp32 model's head as Q8_0 blocks, as a Q4_1 GGUF file does
        assert head is not None and head.kind == "q8_0"
        dense.lm_head_weight = torch.nn.Parameter(head.dequantize(), requires_grad=False)
    else:
        assert head is None  # the head stays dense
    ids = [1, 450, 3001, 97, 12, 5000, 23, 8]
    before = next_token_logits(dense, ids)
    with torch.no_grad():
        for dense_layer, layer in zip(dense.layers, model.layers, strict=True):
            assert "qkv_weight" not in dict(layer.named_parameters())
            for attr in LlamaFamilyModel.QUANTIZABLE:
                q = getattr(layer, attr)
                assert isinstance(q, quant.QuantLinear) and q.kind == quant.METHODS[method][0]
                getattr(dense_layer, attr).copy_(q.dequantize())
    got, ref = next_token_logits(model, ids), next_token_logits(dense, ids)
    assert not torch.equal(got, before)  # the codes differ from the dense weights ...
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)  # ... and are what the model computes with


def test_q8_0_blocks_round_to_a_scale_per_32_inputs() -> None:
    torch.manual_seed(3)
    weight = torch.randn(8, 96)
    q = quant.quantize_q8_0(weight)
    assert (q.kind, q.group, tuple(q.data.shape), tuple(q.scales.shape)) == ("q8_0", 32, (8, 96), (8, 3))
    step = q.scales.repeat_interleave(32, dim=1)
    assert bool(((q.dequantize() - weight).abs() <= step / 2 + 1e-7).all())
    # weights already on a Q8_0 grid (a GGUF head expanded) come back exactly
    torch.testing.assert_close(quant.quantize_q8_0(q.dequantize()).dequantize(), q.dequantize(), rtol=0, atol=1e-7)


def test_lm_head_format_per_method_and_dtype() -> None:
    head = torch.randn(64, 96)
    for method in ("int4", "int4-g32", "int4-g64", "int4-g128"):
        got = quant.lm_head_format(head, method)
        assert got is not None and got.kind == "q8_0", method
    for method in ("int8", "fp8", "rtn"):  # vLLM's online methods (and its rtn) leave the head dense
        assert quant.lm_head_format(head, method) is None, method
    assert quant.lm_head_format(head.bfloat16(), "int4") is None  # a bf16 head: the greedy screen reads it dense
    assert quant.lm_head_format(torch.randn(64, 100), "int4") is None  # K not a multiple of 32


def test_bad_quantization_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--quantization 'int3'"):
        EngineConfig(quantization="int3").resolve(512)
    model = LlamaFamilyModel.from_pretrained(tiny_model_path("llama"), torch.float32, torch.device("cpu"), 64)
    with pytest.raises(ConfigError, match="gguf"):
        quant.quantize_model(model, "gguf", None)


def test_cli_quantization_reaches_the_engine_config() -> None:
    from nxdserve.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["--quantization", "int8"])
    assert engine_config_from_args(args).quantization == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--quantization", "awq"])


def _default_model(method: str | None) -> LlamaFamilyModel:
    from nxdserve.model_files import default_gguf_path, resolve_model

    model = LlamaFamilyModel.from_pretrained(resolve_model(None), torch.float32, torch.device("cpu"), max_len=512)
    if method is not None:
        quant.quantize_model(model, method, default_gguf_path())
    return model


@pytest.mark.slow  # 25 s: two default models, the exact fp32 int4 kernel
def test_default_gguf_served_from_its_blocks_gives_the_expanded_logits(exact_kernels: None) -> None:
    """The default model's Q4_1 file kept in its blocks = transformers' fp32 expansion, to fp32 rounding."""
    dense, kept = _default_model(None), _default_model("gguf")
    for attr in quant_attrs():
        q = getattr(kept.layers[3], attr)
        assert isinstance(q, quant.QuantLinear) and q.kind == "int4" and q.group == 32
        # The weights are the file's: expanding the kept blocks gives the dense folder's tensors.
        torch.testing.assert_close(q.dequantize(), getattr(dense.layers[3], attr).detach(), rtol=0, atol=2e-7)
    assert kept.lm_head_quant is not None and kept.lm_head_quant.kind == "q8_0"
    ids = [1, 504, 3458, 314, 253, 1345, 28, 1672, 30, 2]
    ref, got = next_token_logits(dense, ids), next_token_logits(kept, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def quant_attrs() -> tuple[str, ...]:
    return LlamaFamilyModel.QUANTIZABLE


def test_engine_serves_a_quantized_model_through_the_torch_backend() -> None:
    from nxdserve.sampling_params import SamplingParams
    from tests.helpers.engine import make_core, run_to_completion

    core = make_core(model=str(tiny_model_path("llama")), quantization="int4", max_model_len=64, max_num_seqs=4)
    model = core.backend.model
    assert isinstance(model.layers[1].down_weight, quant.QuantLinear)
    prompts = [[1, 450, 3001, 97], [1, 12, 5000, 23, 8, 77]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in run_to_completion(core, prompts, params)]
    alone = [run_to_completion(core, [p], params)[0].outputs[0].token_ids for p in prompts]
    assert all(len(t) == 6 for t in together)
    assert together == alone  # rows batched or alone: the same quantized compute per row


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_every_runnable_cpu_path_gives_the_same_quantized_logits(method: str, exact_kernels: None) -> None:
    """--cpu-isa forced to each path this CPU runs (avx2 / generic / none here; avx512bf16 / amx where present):
    the quantized model's logits equal the kernel-free path's (``none``), prefill and decode. The C paths compute
    the codes in fp32 (``cpu_weight_kernels.qgemm``), so ``none``'s PyTorch kernels get fp32 activations too."""
    from nxdserve.cpu_options import CpuOptions
    from nxdserve.engine.models import cpu_build, cpu_setup

    model = LlamaFamilyModel.from_pretrained(tiny_model_path("llama"), torch.float32, torch.device("cpu"), 64)
    quant.quantize_model(model, method)
    ids = [1, 450, 3001, 97, 12, 5000, 23, 8]
    results = {}
    try:
        for path in cpu_build.runnable_paths():
            assert cpu_setup.apply(CpuOptions(isa=path)) == path
            results[path] = next_token_logits(model, ids)
    finally:
        cpu_setup.apply(CpuOptions())
    assert "none" in results and len(results) >= 2
    for path, logits in results.items():
        # The C paths sum each block's products in another order than PyTorch's int4/int8 kernels: fp32 rounding
        # through the layers reaches ~1e-5 on logits of ~5 (measured 9.3e-6 on avx2).
        torch.testing.assert_close(logits, results["none"], rtol=1e-5, atol=5e-5, msg=path)
