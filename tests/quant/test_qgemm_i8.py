"""The int8-activation quantized GEMM (csrc/qgemm_i8.c, ``CpuOptions.quant_int8_activations``): on every runnable
kernel path it computes, to fp32 rounding, the float64 product of the weights with the activations rounded to int8
per 32-block (so on activations already on that grid, the exact product), and it stays within that rounding's
bound of the fp32 kernel. The standalone check program (tests/quant/qgemm_i8_check.c) runs each x86 variant here
and the aarch64 builds (NEON's dot-product and widening paths) under qemu-user."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.models import cpu_build, cpu_setup, quant
from tests.helpers.cpu_paths import forced_cpu_path
from tests.unit import test_cross_arch as cross

KERNEL_PATHS = [p for p in cpu_build.runnable_paths() if p != "none"]
ROWS = (1, 2, 3, 7, 8, 9, 15, 16, 17)
N = 77  # not a multiple of 8, 16 or 32
CHECK = Path(__file__).resolve().parent / "qgemm_i8_check.c"


@pytest.fixture(params=KERNEL_PATHS)
def kernel_path(request: pytest.FixtureRequest) -> Iterator[str]:
    with forced_cpu_path(request.param, quant_dense_rows=0) as isa:
        yield isa


def _round_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's rounding, in float64: per 32-block d = absmax / 127 and q = round-half-even(x / d) (x padded to
    whole blocks with zeros). Returns (q * d, d) with d per element."""
    rows, k = x.shape
    blocks = F.pad(x, (0, -k % 32)).view(rows, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))  # fp32, as the kernel
    q = torch.round(blocks * inv).clamp(-127, 127)
    full = (q.double() * d.double()).view(rows, -1)[:, :k]
    return full, d.double().expand_as(blocks).reshape(rows, -1)[:, :k]


def _weights(fmt: str, k: int, gen: torch.Generator) -> tuple[quant.QuantLinear, torch.Tensor]:
    if fmt == "q4":
        padded = -(-k // 32) * 32
        codes = torch.randint(0, 16, (N, padded), generator=gen, dtype=torch.int32)
        scale = torch.rand(N, padded // 32, generator=gen) * 0.02 + 1e-3
        offset = torch.randn(N, padded // 32, generator=gen) * 0.1
        q = quant.int4_from_codes(codes, scale, offset, 32, k)
    else:
        q = quant.quantize(torch.randn(N, k, generator=gen) * 0.1, "int8")
    return q, q.dequantize().double()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_int8_activations_compute_the_rounded_product_and_stay_within_its_bound(
    kernel_path: str, fmt: str, threads: int
) -> None:
    """Odd K (padded to whole blocks), odd N, tiles of 1-8 rows and more, a residual, on 1 and 2 threads."""
    gen = torch.Generator().manual_seed(7 * threads + len(fmt))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in (64, 200, 576):
            q, dense = _weights(fmt, k, gen)
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen) * torch.rand(rows, k, generator=gen)
                x[0, :32] = 0.0  # an all-zero block: d = 0
                residual = torch.randn(rows, N, generator=gen)
                quant.int8_activations = False
                exact = q(x, residual)
                quant.int8_activations = True
                got = q(x, residual)
                limit = quant.int8_activation_rows()
                if limit and rows >= limit:  # the build's fp32 kernels take these calls (faster there)
                    torch.testing.assert_close(got, exact, rtol=0, atol=0)
                    continue
                rounded, d = _round_activations(x)
                magnitude = (rounded.abs() @ dense.abs().t()).max().item()
                ref = rounded @ dense.t() + residual.double()
                torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=magnitude * 2e-6)
                # within the activations' rounding (half a step per element) of the fp32 kernel's exact product
                bound = (d * 0.5) @ dense.abs().t() + magnitude * 4e-6
                assert bool(((got.double() - exact.double()).abs() <= bound).all())
                assert not torch.equal(got, exact)  # the rounding happened: this is not the fp32 kernel
                # rows apart in memory (stride > K) and bf16 activations take the same rounding
                strided = torch.zeros(rows, k + 40)
                strided[:, 3 : 3 + k] = x
                torch.testing.assert_close(q(strided[:, 3 : 3 + k], residual), got, rtol=0, atol=0)
                xb = x.bfloat16()
                torch.testing.assert_close(q(xb).float(), q(xb.float()).bfloat16().float(), rtol=0, atol=0)
    finally:
        quant.int8_activations = False
        torch.set_num_threads(saved)


def test_on_grid_activations_give_the_exact_product(kernel_path: str) -> None:
    """Activations already on the int8 grid of their block (absmax 127 * 2^e): nothing is rounded, so the result
    is the float64 product to fp32 rounding, for both formats."""
    gen = torch.Generator().manual_seed(3)
    k = 576
    steps = 2.0 ** torch.randint(-9, -2, (5, k // 32, 1), generator=gen).float()
    ints = torch.randint(-127, 128, (5, k // 32, 32), generator=gen).float()
    ints[:, :, 5] = 127.0
    x = (ints * steps).view(5, k)
    for fmt in ("q4", "q8"):
        q, dense = _weights(fmt, k, gen)
        quant.int8_activations = True
        try:
            got = q(x)
        finally:
            quant.int8_activations = False
        ref = x.double() @ dense.t()
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=(x.double().abs() @ dense.abs().t()).max() * 2e-6)


def test_fp8_weights_and_the_torch_path_ignore_the_switch() -> None:
    """fp8 codes have no integer form (the C function runs the fp32 kernel); without kernels the torch ops run."""
    torch.manual_seed(4)
    x = torch.randn(3, 96)
    fp8 = quant.quantize(torch.randn(N, 96) * 0.1, "fp8")
    int4 = quant.quantize(torch.randn(N, 96) * 0.1, "int4-g32")
    paths = [*KERNEL_PATHS[:1], "none"]
    for path in paths:
        with forced_cpu_path(path, quant_dense_rows=0):
            before = (fp8(x), int4(x))
            with forced_cpu_path(path, quant_dense_rows=0, quant_int8_activations=True):
                assert quant.int8_activations
                after = (fp8(x), int4(x))
            torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
            if path == "none":
                torch.testing.assert_close(after[1], before[1], rtol=0, atol=0)
    assert not quant.int8_activations


def test_option_and_flag() -> None:
    from nxdserve.cli import build_parser, engine_config_from_args

    assert CpuOptions().quant_int8_activations is False
    args = build_parser().parse_args(["--cpu-quant-int8-activations"])
    assert engine_config_from_args(args).cpu.quant_int8_activations is True
    assert engine_config_from_args(build_parser().parse_args([])).cpu.quant_int8_activations is False
    try:
        cpu_setup.apply(CpuOptions(quant_int8_activations=True))
        assert quant.int8_activations
    finally:
        cpu_setup.apply(CpuOptions())
    assert not quant.int8_activations
    with pytest.raises(Exception, match="quant_int8_activations"):
        CpuOptions(quant_int8_activations=1)  # type: ignore[arg-type]


def _run_check_program(cc: list[str], flags: list[str], out: Path, runner: list[str]) -> None:
    cmd = [*cc, *cpu_build.COMPILE_FLAGS, *flags, "-I", str(cpu_build.CSRC), str(CHECK), "-o", str(out), "-lm"]
    import subprocess

    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cross._run_check([*runner, str(out)])


@cross.needs_compiler
@pytest.mark.slow  # ~10 s a variant; the library tests above run the same paths in the default suite
@pytest.mark.parametrize("variant", cross.HOST_VARIANTS)
def test_check_program_on_every_host_variant(variant: str, tmp_path: Path) -> None:
    cc = cpu_build.compiler()
    assert cc is not None
    _run_check_program(cc, cpu_build.target_flags(variant), tmp_path / f"check-{variant}", [])


@cross.needs_cross
@pytest.mark.parametrize("variant", cross._slow_but_first(list(cpu_build.VARIANTS["aarch64"])[::-1]))
def test_check_program_on_aarch64_under_qemu(variant: str, tmp_path: Path) -> None:
    """neon (armv8.2-a+dotprod: ``vdotq_s32``) in the default suite; generic (armv8-a: widening multiplies) slow."""
    flags = cpu_build.target_flags(variant, "aarch64")
    _run_check_program([cross.CROSS_CC], flags, tmp_path / f"check-{variant}", [cross.QEMU, "-L", str(cross.SYSROOT)])


@pytest.mark.skipif(not KERNEL_PATHS, reason="no C kernels")
def test_engine_applies_the_switch_and_stays_close_to_the_exact_path() -> None:
    """A tiny 4-bit model through the engine, switch off then on: the option reaches QuantLinear (the greedy
    token's logprobs change) and the results stay close (activation rounding only). Not asserted equal."""
    from nxdserve.sampling_params import SamplingParams
    from tests.helpers.engine import make_core, run_to_completion
    from tests.helpers.tiny_model import single_torch_thread, tiny_model_path

    path = str(tiny_model_path("llama"))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[1, 5, 9, 200, 31, 7], [1, 42, 42, 17]]
    logprobs = {}
    try:
        with single_torch_thread():
            for int8 in (False, True):
                core = make_core(model=path, quantization="int4", cpu=CpuOptions(quant_int8_activations=int8))
                assert quant.int8_activations is int8
                outs = run_to_completion(core, prompts, params)
                first = [o.outputs[0].logprobs[0] for o in outs]  # type: ignore[index]
                logprobs[int8] = [{t: lp.logprob for t, lp in entry.items()} for entry in first]
    finally:
        cpu_setup.apply(CpuOptions())
    for exact, rounded in zip(logprobs[False], logprobs[True], strict=True):
        shared = exact.keys() & rounded.keys()
        assert shared  # the top candidates overlap
        diffs = [abs(exact[t] - rounded[t]) for t in shared]
        assert max(diffs) < 0.05
    assert any(exact != rounded for exact, rounded in zip(logprobs[False], logprobs[True], strict=True))


@pytest.mark.slow  # ~1.5 min: the default model as served, the sample's 404 rows on the kernel twice, and bf16
@pytest.mark.skipif(not KERNEL_PATHS, reason="no C kernels")
def test_default_model_perplexity_with_int8_activations() -> None:
    """Measured +0.75% over the exact kernel's perplexity (+0.69% over the bf16 model's), top-1 agreement 0.975
    as one 404-row call; in the 8-row chunks the AVX2 build's limit takes now, +0.54% and 0.973 (perf_notes.md).
    Bounded at 2% and 0.95."""
    from benchmarks.qgemm_i8_accuracy import kernel_logits
    from nxdserve.engine.models.perplexity import perplexity, sample_token_ids, top1_agreement

    ids = sample_token_ids()
    logits = kernel_logits(ids)
    exact, int8 = perplexity(logits["exact"], ids), perplexity(logits["int8"], ids)
    assert abs(int8 / exact - 1) < 0.02
    assert top1_agreement(logits["int8"], logits["exact"]) > 0.95
