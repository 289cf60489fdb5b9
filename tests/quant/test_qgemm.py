"""The quantized-weight GEMM for a few rows (csrc/qgemm.c, ``cpu_weight_kernels.qgemm``, ``quant.QuantLinear``): on
every runnable kernel path it computes the dense fp32 expansion of its codes to fp32 rounding; GGUF blocks through
``gguf_weights`` compute the ``gguf`` package's dequantized blocks; the default model's 4-bit path gives the logits
of a dense fp32 model holding the same dequantized blocks."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.models import cpu_build, cpu_kernels, cpu_setup, cpu_weight_kernels, quant
from nxdserve.engine.models.gguf_weights import decode_4bit, decode_q8_0
from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.engine.models.perplexity import next_token_logits
from nxdserve.errors import ConfigError
from tests.helpers.cpu_paths import forced_cpu_path

PATHS = cpu_build.runnable_paths()
KERNEL_PATHS = [p for p in PATHS if p != "none"]
ROWS = (1, 2, 3, 5, 8, 9, 12, 17)  # paired from 9 (AVX2) or 12 (3 for bf16); 17 a partial tile and an odd N
WIDTHS = (64, 576, 1536)
N = 77  # not a multiple of 8 or 16


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each path this CPU runs, forced; the torch path (``none``) with fp32 activations (the exact reference)."""
    saved = quant.kernel_dtype
    quant.kernel_dtype = None
    with forced_cpu_path(request.param, quant_dense_rows=0) as isa:
        yield isa
    quant.kernel_dtype = saved


def _close(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """Equal to fp32 rounding: relative 1e-5, plus a bound on the rounding of sums of |w x| (a different order)."""
    scale = (x.abs() @ dense.abs().t()).max().item()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=scale * 2e-6)


def _arm() -> bool:
    return cpu_build.machine() == "aarch64"


def _q4_codes(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    offset = torch.randn(n, k // 32, generator=gen) * 0.1
    return codes, scale, offset


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["q4", "q8", "fp8", "bf16"])
@pytest.mark.parametrize("kernel_path", KERNEL_PATHS)
def test_kernel_equals_the_dense_fp32_expansion(kernel_path: str, fmt: str, threads: int) -> None:
    assert cpu_setup.apply(CpuOptions(isa=kernel_path)) == kernel_path
    gen = torch.Generator().manual_seed(len(fmt) + threads)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in WIDTHS:
            if fmt == "q4":
                codes, scale, offset = _q4_codes(N, k, gen)
                q = quant.int4_from_codes(codes, scale, offset, 32, k)
                weight, scales, offsets = q.data, q.scales, q.offsets
                dense = (codes.float().view(N, -1, 32) * scale[..., None] + offset[..., None]).view(N, k)
            elif fmt == "bf16":  # the weight itself, no scales: each value widened exactly
                weight, scales, offsets = torch.randn(N, k, generator=gen).to(torch.bfloat16), None, None
                dense = weight.float()
            elif fmt == "q8":
                weight = torch.randint(-127, 128, (N, k), generator=gen, dtype=torch.int8)
                scales, offsets = torch.rand(N, k // 32, generator=gen) * 0.01, None
                dense = (weight.float().view(N, -1, 32) * scales[..., None]).view(N, k)
            else:
                weight = (torch.randn(N, k, generator=gen) * 100).to(torch.float8_e4m3fn)
                scales, offsets = torch.rand(N, k // 32, generator=gen) * 0.01, None
                dense = (weight.float().view(N, -1, 32) * scales[..., None]).view(N, k)
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen)
                residual = torch.randn(rows, N, generator=gen)
                ref = F.linear(x, dense)
                _close(cpu_weight_kernels.qgemm(x, weight, scales, offsets, fmt), ref, x, dense)
                _close(cpu_weight_kernels.qgemm(x, weight, scales, offsets, fmt, residual), ref + residual, x, dense)
                strided = torch.randn(rows, k + 32, generator=gen)[:, :k]  # rows not packed together
                got = cpu_weight_kernels.qgemm(strided, weight, scales, offsets, fmt)
                _close(got, F.linear(strided, dense), x, dense)
    finally:
        torch.set_num_threads(saved)
        cpu_setup.apply(CpuOptions())


@pytest.mark.parametrize("method", ["int8", "fp8", "int4-g32", "int4-g64", "int4-g128", "bf16"])
def test_quant_linear_computes_its_dequantized_weight_on_every_path(path: str, method: str) -> None:
    """K = 200 (padded to the group), rows on both sides of the dense-copy threshold, a residual."""
    torch.manual_seed(0)
    weight = torch.randn(N, 200) * 0.1
    q = quant.store_bf16(weight) if method == "bf16" else quant.quantize(weight, method)
    dense = q.dequantize()
    if method == "bf16":
        assert torch.equal(dense, weight.bfloat16().float())
    for rows in ROWS:
        x, residual = torch.randn(rows, 200), torch.randn(rows, N)
        _close(q(x), F.linear(x, dense), x, dense)
        _close(q(x, residual), F.linear(x, dense) + residual, x, dense)
        xb = x.bfloat16()
        out = q(xb)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), F.linear(xb.float(), dense), rtol=2e-2, atol=2e-2)  # bf16 out


@pytest.mark.parametrize("method", ["int8", "fp8", "int4-g32", "int4-g128"])
@pytest.mark.parametrize("kernel_path", KERNEL_PATHS)
def test_fp32_calls_of_any_size_keep_no_dense_copy(kernel_path: str, method: str) -> None:
    """fp32 activations: above ``dense_rows`` the kernel's paired rows up to kernel_rows() (a transient widened copy
    on a build without them), a transient widened copy above it; the same products to fp32 rounding, and only
    the codes' kernel layout stays on the weight."""
    torch.manual_seed(1)
    q = quant.quantize(torch.randn(N, 576) * 0.1, method)
    dense = q.dequantize()
    try:
        for rows_option in (0, 4):
            cpu_setup.apply(CpuOptions(isa=kernel_path, quant_dense_rows=rows_option))
            paired = kernel_path != "generic" or _arm()
            assert cpu_kernels.built("qgemm_paired_available") == paired
            # The AVX2 build takes 64 rows on its paired rows (its loads held in registers), the others 32.
            limit = quant.kernel_rows()
            assert limit == (64 if kernel_path == "avx2" else quant.KERNEL_ROWS if paired else 0)
            for rows in sorted({3, 9, 12, quant.KERNEL_ROWS, limit, limit + 1, 150} - {0, 1}):
                x = torch.randn(rows, 576)
                _close(q(x), F.linear(x, dense), x, dense)
        assert set(q.__dict__.get("_cache", {})) <= {"kernel"}
    finally:
        cpu_setup.apply(CpuOptions())


def test_bf16_calls_above_the_threshold_use_a_kept_bf16_copy() -> None:
    """bf16 activations (a bf16 model, whose fused forward reads the same copy) above ``dense_rows``: a dense bf16
    copy made once; at or below it the kernel on the codes."""
    torch.manual_seed(1)
    q = quant.quantize(torch.randn(N, 576) * 0.1, "int4-g32")
    x = torch.randn(12, 576).bfloat16()
    try:
        cpu_setup.apply(CpuOptions(quant_dense_rows=0))
        kernel = q(x)
        assert ("dense", torch.bfloat16) not in q.__dict__.get("_cache", {})  # 0: no dense copy is ever made
        cpu_setup.apply(CpuOptions(quant_dense_rows=4))
        copied = q(x)
        assert ("dense", torch.bfloat16) in q.__dict__["_cache"]  # with or without the kernels
        assert q(x[:4]).shape == (4, N)
    finally:
        cpu_setup.apply(CpuOptions())
    torch.testing.assert_close(kernel.float(), copied.float(), rtol=2e-2, atol=2e-2)  # bf16 outputs


@pytest.mark.parametrize("fmt", ["q4", "q8", "fp8", "bf16"])
@pytest.mark.parametrize("kernel_path", KERNEL_PATHS)
def test_widened_copy_equals_the_dense_expansion(kernel_path: str, fmt: str) -> None:
    """``QgemmWeight.to_f32`` (csrc/qgemm.c's q_widen_f32): each weight to one fp32 rounding of code * scale +
    offset, on every build."""
    assert cpu_setup.apply(CpuOptions(isa=kernel_path)) == kernel_path
    gen = torch.Generator().manual_seed(7)
    try:
        k = 576
        if fmt == "q4":
            codes, scale, offset = _q4_codes(N, k, gen)
            q = quant.int4_from_codes(codes, scale, offset, 32, k)
            layout, dense = (q.data, q.scales, q.offsets), q.dequantize()
        elif fmt == "bf16":
            weight = torch.randn(N, k, generator=gen).to(torch.bfloat16)
            layout, dense = (weight, None, None), weight.float()
        else:
            weight = torch.randint(-127, 128, (N, k), generator=gen, dtype=torch.int8)
            if fmt == "fp8":
                weight = (torch.randn(N, k, generator=gen) * 100).to(torch.float8_e4m3fn)
            scales = torch.rand(N, k // 32, generator=gen) * 0.01
            layout, dense = (weight, scales, None), (weight.float().view(N, -1, 32) * scales[..., None]).view(N, k)
        wide = cpu_weight_kernels.QgemmWeight(*layout, fmt).to_f32()
        torch.testing.assert_close(wide, dense, rtol=2e-7, atol=1e-7)
    finally:
        cpu_setup.apply(CpuOptions())


def test_without_kernels_small_calls_take_torch_ops_and_large_ones_the_dense_copy() -> None:
    torch.manual_seed(2)
    q = quant.quantize(torch.randn(N, 576) * 0.1, "int4-g32")
    x = torch.randn(24, 576)
    with forced_cpu_path("none"):
        assert not cpu_kernels.available()
        small = q(x[:8])
        cache = q.__dict__["_cache"]
        assert "int4pack" in cache and ("dense", torch.float32) not in cache
        large = q(x)
        assert ("dense", torch.float32) in cache
    dense = q.dequantize()
    torch.testing.assert_close(small, F.linear(x[:8], dense), rtol=2e-2, atol=2e-2)  # int4pack: bf16 activations
    _close(large, F.linear(x, dense), x, dense)


def test_quant_dense_rows_option_and_flag() -> None:
    from nxdserve.cli import build_parser, engine_config_from_args

    assert CpuOptions().quant_dense_rows == quant.DENSE_ROWS
    args = build_parser().parse_args(["--cpu-quant-dense-rows", "0"])
    assert engine_config_from_args(args).cpu.quant_dense_rows == 0
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigError, match="quant_dense_rows"):
            CpuOptions(quant_dense_rows=bad)  # type: ignore[arg-type]


def _gguf_blocks(kind: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF tensor's raw blocks and the gguf package's fp32 dequantization of them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = getattr(GGMLQuantizationType, kind)
    rng = np.random.default_rng(len(kind) + cols)
    if kind == "Q4_K":  # the package cannot quantize Q4_K: any bytes with finite d / dmin are valid blocks
        raw = rng.integers(0, 256, size=(rows, cols // 256 * 144), dtype=np.uint8)
        for b in range(cols // 256):
            raw[:, b * 144 : b * 144 + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
            raw[:, b * 144 + 2 : b * 144 + 4] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)
    else:
        raw = quantize((rng.standard_normal((rows, cols)) * 0.2).astype(np.float32), qtype)
    return raw, dequantize(raw, qtype)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_gguf_blocks_through_the_kernel_compute_the_gguf_packages_values(path: str, kind: str) -> None:
    cols = 512 if kind == "Q4_K" else 576
    raw, reference = _gguf_blocks(kind, N, cols)
    q = decode_q8_0(raw, cols) if kind == "Q8_0" else quant.int4_from_codes(*decode_4bit(kind, raw, cols), 32, cols)
    dense = torch.from_numpy(reference)
    for rows in (1, 3, 17):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        _close(q(x), F.linear(x, dense), x, dense)


@pytest.fixture(scope="module")
def default_models() -> Iterator[tuple[LlamaFamilyModel, LlamaFamilyModel]]:
    """The default model with --quantization gguf, and a dense fp32 one holding its dequantized blocks."""
    from nxdserve.model_files import default_gguf_path, resolve_model

    dense = LlamaFamilyModel.from_pretrained(resolve_model(None), torch.float32, torch.device("cpu"), 64)
    kept = copy.deepcopy(dense)
    quant.quantize_model(kept, "gguf", default_gguf_path())
    with torch.no_grad():
        for kept_layer, dense_layer in zip(kept.layers, dense.layers, strict=True):
            for attr in LlamaFamilyModel.QUANTIZABLE:
                getattr(dense_layer, attr).copy_(getattr(kept_layer, attr).dequantize())
    assert kept.lm_head_quant is not None and kept.lm_head_quant.kind == "q8_0"
    dense.lm_head_quant = None
    yield kept, dense


def test_default_model_gguf_logits_equal_its_dequantized_blocks_in_fp32(
    default_models: tuple[LlamaFamilyModel, LlamaFamilyModel],
) -> None:
    """Issue 29 item 5: the 4-bit layers and the Q8_0 head kept in their blocks, computed by the kernel (prefill
    rows too), give the logits of the dense fp32 model holding the same blocks expanded, to fp32 rounding."""
    kept, dense = default_models
    assert kept.lm_head_quant is not None
    ids = [1, 504, 3458, 314, 253, 1345, 28, 1672]
    try:
        cpu_setup.apply(CpuOptions(quant_dense_rows=0))
        got = next_token_logits(kept, ids)
    finally:
        cpu_setup.apply(CpuOptions())
    saved = dense.lm_head_weight
    dense.lm_head_weight = torch.nn.Parameter(kept.lm_head_quant.dequantize(), requires_grad=False)
    try:
        ref = next_token_logits(dense, ids)
    finally:
        dense.lm_head_weight = saved
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=float(ref.abs().max()) * 1e-5)


@pytest.mark.parametrize("method", ["int8", "fp8", "int4-g32", "bf16"])
def test_a_served_weight_holds_its_codes_once(method: str) -> None:
    """After calls of every size in fp32, a weight's memory is its codes and scales (plus the kernel's per-block
    scales), not a second copy of the codes (the bf16 layout once padded a copy) nor a dense copy."""
    torch.manual_seed(3)
    weight = torch.randn(N, 576) * 0.1
    q = quant.store_bf16(weight) if method == "bf16" else quant.quantize(weight, method)
    for rows in (1, 20, 40):
        q(torch.randn(rows, 576))
    storages: dict[int, int] = {}

    def visit(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif isinstance(obj, dict | list | tuple):
            for value in obj.values() if isinstance(obj, dict) else obj:
                visit(value)
        elif isinstance(obj, cpu_weight_kernels.QgemmWeight):
            visit(obj.tensors)

    visit(vars(q))
    per_block_scales = N * 576 // 32 * 4
    assert sum(storages.values()) <= q.nbytes + per_block_scales


@pytest.mark.skipif(not KERNEL_PATHS or cpu_build.compiler() is None, reason="no C kernels on this machine")
def test_a_build_with_other_defines_runs_in_place_of_the_paths_own_and_is_put_back() -> None:
    """``benchmarks/kernel_ab.py``'s mechanism: a build of the running variant with a knob changed (the prefetch
    distance: the same arithmetic) serves the calls inside ``running_library`` and gives the same results; the
    path's own library serves them again afterwards."""
    gen = torch.Generator().manual_seed(7)
    codes, scale, offset = _q4_codes(N, 576, gen)
    weight = quant.int4_from_codes(codes, scale, offset, 32, 576)
    x = torch.randn(3, 576, generator=gen)
    own = cpu_kernels._library()
    other = cpu_kernels.build_running_variant(["-DQPF=1024"])
    assert other is not own and other._name != own._name  # another file: the defines key the cache
    kernel = weight._kernel_args()
    expected = kernel(x)
    with cpu_kernels.running_library(other):
        assert cpu_kernels._library() is other
        got = kernel(x)
    assert cpu_kernels._library() is own
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("fmt", ["q4", "q8", "fp8", "bf16"])
@pytest.mark.parametrize("kernel_path", KERNEL_PATHS)
def test_argmax_kept_as_rows_are_written_is_argmax_of_the_outputs(
    kernel_path: str, fmt: str, int8_activations: bool
) -> None:
    """``QgemmWeight.argmax``: on 1 and 2 threads, for single rows and the paired rows, the index that
    ``cpu_kernels.argmax`` finds in the outputs' first ``cols`` columns. Duplicated weight rows tie (the first wins),
    columns beyond ``cols`` are never picked, a NaN output is above all (its first column wins), -0 equals +0."""
    n, k = 301, 576
    gen = torch.Generator().manual_seed(len(fmt) * 7 + int8_activations)
    if fmt == "q4":
        codes, scale, offset = _q4_codes(n, k, gen)
        q = quant.int4_from_codes(codes, scale, offset, 32, k)
        weight, scales, offsets = q.data, q.scales, q.offsets
    elif fmt == "bf16":
        weight, scales, offsets = torch.randn(n, k, generator=gen).to(torch.bfloat16), None, None
    elif fmt == "q8":
        weight, offsets = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), None
        scales = torch.rand(n, k // 32, generator=gen) * 0.01
    else:
        weight, offsets = (torch.randn(n, k, generator=gen) * 100).to(torch.float8_e4m3fn), None
        scales = torch.rand(n, k // 32, generator=gen) * 0.01
    # Columns 10 and 200: the same weight, aligned with x0's signs at the largest scale, so that for the row x0
    # they tie as the largest output (the first must win).
    x0 = torch.randn(k, generator=gen)
    for col in (10, 200):
        if fmt == "q4":
            aligned = torch.where(x0 > 0, 15, 0).to(torch.int32)
            row = quant.int4_from_codes(aligned[None], scales[:1].clone(), torch.zeros(1, k // 32), 32, k)
            weight[col], offsets[col] = row.data[0], 0.0
        elif fmt == "bf16":
            weight[col] = torch.where(x0 > 0, 3.0, -3.0).to(torch.bfloat16)
        elif fmt == "q8":
            weight[col] = torch.where(x0 > 0, 127, -127).to(torch.int8)
        else:
            weight[col] = torch.where(x0 > 0, 400.0, -400.0).to(torch.float8_e4m3fn)
        if scales is not None:
            scales[col] = scales.max() if fmt != "q4" else scales[0]
    kernel = cpu_weight_kernels.QgemmWeight(weight, scales, offsets, fmt)
    saved = torch.get_num_threads()
    try:
        with forced_cpu_path(kernel_path):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for rows in (1, 3, 12, 17):
                    x = torch.randn(rows, k, generator=gen)
                    x[0] = x0
                    out = kernel(x, None, int8_activations)
                    assert out[0, 10] == out[0, 200] == out[0].max()
                    for cols in (n, 150):
                        expected = cpu_kernels.argmax(out[:, :cols].contiguous())
                        got = kernel.argmax(x, cols, int8_activations)
                        assert got.tolist() == expected.tolist(), (threads, rows, cols)
                        assert int(got.max()) < cols and int(got[0]) == 10
            if fmt in ("q8", "fp8") and scales is not None:  # a NaN scale: that column's output is NaN
                scales[250, 0] = float("nan")
                scales[260, 0] = float("nan")
                nan_kernel = cpu_weight_kernels.QgemmWeight(weight, scales, offsets, fmt)
                x = torch.randn(2, k, generator=gen)
                assert nan_kernel.argmax(x, n, int8_activations).tolist() == [250, 250]
                assert nan_kernel.argmax(x, 255, int8_activations).tolist() == [250, 250]
                assert int(nan_kernel.argmax(x, 250, int8_activations)[0]) < 250
            finite = None if scales is None else torch.ones_like(scales)
            zero = cpu_weight_kernels.QgemmWeight(torch.zeros_like(weight), finite, offsets, fmt)
            x = -torch.ones(1, k)  # every output 0 or -0 (q4's offsets aside): the first column
            if fmt != "q4":
                assert zero.argmax(x, n, int8_activations).tolist() == [0]
    finally:
        torch.set_num_threads(saved)
    with pytest.raises(ValueError, match="columns"):
        kernel.argmax(torch.randn(1, k), n + 1)
