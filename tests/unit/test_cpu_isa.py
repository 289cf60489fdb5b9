"""The C kernels' ISA variants: every variant compiles with -Werror, every path this CPU runs gives the torch
path's results, impossible paths are ConfigErrors, a missing compiler or a wrong struct layout falls back.

Variants load side by side in this process (each library RTLD_LOCAL); ``cpu_setup.apply`` switches between them.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re
import subprocess
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from nxdserve.config import EngineConfig
from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.backends.torch_backend import TorchBackend
from nxdserve.engine.models import SlotModelRunner, cpu_build, cpu_kernels, cpu_setup
from nxdserve.errors import ConfigError
from tests.helpers.cpu_paths import forced_cpu_path
from tests.helpers.tiny_model import single_torch_thread, tiny_model_path
from tests.unit.test_torch_backend import run_greedy
from tests.unit.test_torch_model import ATOL_TINY, chunk_steps, random_ids, reference_logits, run_schedule

PATHS = cpu_build.runnable_paths()
VARIANTS = list(cpu_build.VARIANTS.get(cpu_build.machine(), {}))
needs_compiler = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    with forced_cpu_path(request.param) as isa:
        yield isa


def _target_flags_supported(variant: str) -> bool:
    cc = cpu_build.compiler()
    assert cc is not None
    flags = cpu_build.VARIANTS[cpu_build.machine()][variant]
    probe = subprocess.run([*cc, *flags, "-x", "c", "-c", "-o", "/dev/null", "-"], input="int x;\n", text=True,
                           capture_output=True)  # fmt: skip
    return probe.returncode == 0


@needs_compiler
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_compiles_with_werror(variant: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    if not _target_flags_supported(variant):
        pytest.skip(f"this compiler lacks {variant}'s target flags")
    assert "-Werror" in cpu_build.COMPILE_FLAGS
    built = cpu_build.build_variant(variant)  # the cache: the same file a machine of that class loads
    assert built.is_file() and variant in built.name


def test_paths_are_ordered_best_first() -> None:
    avx2 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}
    avx512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni"}
    sapphire = frozenset(avx2 | avx512 | {"amx_tile", "amx_bf16"})
    assert cpu_build.runnable_paths(sapphire, "x86_64") == ["amx", "avx512bf16", "avx2", "generic", "none"]
    zen4 = sapphire - {"amx_tile", "amx_bf16"}
    assert cpu_build.runnable_paths(zen4, "x86_64") == ["avx512bf16", "avx2", "generic", "none"]
    assert cpu_build.runnable_paths(frozenset({"avx2", "fma"}), "x86_64") == ["generic", "none"]
    assert cpu_build.runnable_paths(frozenset({"asimd", "asimdhp", "asimddp"}), "aarch64") == [
        "neon", "generic", "none"
    ]  # fmt: skip


def test_a_path_this_cpu_cannot_run_is_a_config_error() -> None:
    missing = [p for p in ("amx", "avx512bf16", "avx2", "neon", "generic") if p not in PATHS]
    assert missing, "this CPU runs every path"  # at least neon on x86, the x86 ones on aarch64
    try:
        for isa in missing:
            with pytest.raises(ConfigError, match=f"cpu isa '{isa}' cannot run"):
                cpu_setup.apply(CpuOptions(isa=isa))  # type: ignore[arg-type]
    finally:
        cpu_setup.apply(CpuOptions())


def test_no_compiler_means_torch_ops_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
            assert cpu_setup.apply(CpuOptions()) == "none"
        assert not cpu_kernels.available() and cpu_kernels.active_path() == "none"
        assert [r.getMessage() for r in caplog.records] == [
            "no C compiler (CC='/nonexistent/cc'): the CPU forward runs torch ops"
        ]
        x = torch.randn(3, 7)
        assert torch.equal(cpu_kernels.argmax(x), x.argmax(-1))  # the torch fallback
    finally:
        monkeypatch.delenv("CC")
        cpu_setup.apply(CpuOptions())
    assert cpu_kernels.available() == (PATHS[0] != "none")


@needs_compiler
def test_a_library_whose_struct_layout_differs_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = cpu_kernels._library()
    assert lib is not None
    cpu_kernels.check_layouts(lib)  # the real declarations agree

    class Shifted(ctypes.Structure):  # nxd_gemm_args with M and K swapped in type: offsets move
        _fields_ = [(name, ctypes.c_int32 if name == "M" else kind) for name, kind in cpu_kernels.GemmArgs._fields_]

    with pytest.raises(RuntimeError, match="nxd_gemm_args"):
        cpu_kernels.check_layouts(lib, {"nxd_gemm_args": Shifted})
    monkeypatch.setitem(cpu_kernels.STRUCTS, "nxd_gemm_args", Shifted)
    monkeypatch.setattr(cpu_kernels._state, "libs", {})  # load again, through the check
    try:
        cpu_setup.apply(CpuOptions())
        assert not cpu_kernels.available()
    finally:
        monkeypatch.undo()
        cpu_setup.apply(CpuOptions())
    assert cpu_kernels.available()


# -- every runnable path against torch -----------------------------------------------------------------------------


def _attention_reference(q, k_cache, v_cache, slots, positions):  # type: ignore[no-untyped-def]
    groups = q.shape[1] // k_cache.shape[1]
    rows = []
    for t in range(q.shape[0]):
        s, p = int(slots[t]), int(positions[t])
        kc = k_cache[s, :, : p + 1].repeat_interleave(groups, dim=0).float()
        vc = v_cache[s, :, : p + 1].repeat_interleave(groups, dim=0).float()
        rows.append(F.scaled_dot_product_attention(q[t].float()[:, None], kc, vc)[:, 0].reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_torch_on_every_path(path: str, dtype: torch.dtype) -> None:
    if path == "none":
        assert not cpu_kernels.available()
        return
    gen = torch.Generator().manual_seed(7)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    # attention: 3 tokens written into a cache of 4 slots, each attending to its slot
    heads, kv_heads, dim = 6, 2, 64
    k_cache = torch.randn(4, kv_heads, 20, dim, generator=gen).to(dtype)
    v_cache = torch.randn(4, kv_heads, 20, dim, generator=gen).to(dtype)
    q, k, v = (torch.randn(3, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    slots, positions = torch.tensor([2, 0, 3]), torch.tensor([9, 0, 17])
    out = torch.zeros(3, heads * dim, dtype=dtype)
    cpu_kernels.slot_attention(q, k, v, k_cache, v_cache, slots, positions, None, 3, None, out)
    assert torch.equal(k_cache[slots, :, positions], k) and torch.equal(v_cache[slots, :, positions], v)
    torch.testing.assert_close(out.float(), _attention_reference(q, k_cache, v_cache, slots, positions), **tol)
    # rms_norm with a residual add
    x, delta = torch.randn(5, 96, generator=gen).to(dtype), torch.randn(5, 96, generator=gen).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    total, normed = cpu_kernels.rms_norm(x, weight, 1e-6, delta)
    ref_total = x + delta
    ref_normed = weight * (ref_total.float() * torch.rsqrt(ref_total.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(
        dtype
    )
    assert torch.equal(total, ref_total)
    torch.testing.assert_close(normed, ref_normed, **tol)
    # rope on 2 of 3 heads
    rows, rope_dim = 4, 16
    xr = torch.randn(rows, 3 * rope_dim, generator=gen).to(dtype)
    angles = torch.randn(rows, rope_dim // 2, generator=gen).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    heads_view = xr[:, : 2 * rope_dim].view(rows, 2, rope_dim)
    halves = heads_view.chunk(2, dim=-1)
    ref_rope = heads_view * cos[:, None] + torch.cat((-halves[1], halves[0]), -1) * sin[:, None]
    untouched = xr[:, 2 * rope_dim :].clone()
    cpu_kernels.rope_(xr, 2, rope_dim, cos, sin)
    torch.testing.assert_close(xr[:, : 2 * rope_dim].view(rows, 2, rope_dim), ref_rope, **tol)
    assert torch.equal(xr[:, 2 * rope_dim :], untouched)
    # silu_mul and argmax
    gate_up = torch.randn(3, 2 * 40, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), F.silu(gate) * up, **tol)
    logits = torch.randn(5, 1000, generator=gen).to(dtype)
    logits[2, 10] = logits[2, 500] = logits[2].max() + 1  # ties: the first index
    assert torch.equal(cpu_kernels.argmax(logits), logits.argmax(-1))


def test_tiny_model_matches_transformers_on_every_path(path: str) -> None:
    model = tiny_model_path("llama")
    ids = random_ids(40, seed=3)
    runner = SlotModelRunner.from_pretrained(model, num_slots=2, max_len=64, dtype=torch.float32,
                                             device=torch.device("cpu"))  # fmt: skip
    got = run_schedule(runner, {1: ids}, chunk_steps(1, len(ids), 7))[1]
    err = (got - reference_logits(model, ids)).abs().max().item()
    assert err <= ATOL_TINY, f"path {path}: max |ours - transformers| = {err:.3g}"


@functools.cache
def _greedy(path: str, dtype: str) -> dict[int, list[int]]:
    """Six greedy tokens for two prompts through the torch backend on ``path``: prefill chunks mixed with decodes."""
    config = EngineConfig(
        model=str(tiny_model_path("llama")), backend="torch", dtype=dtype, max_model_len=64, max_num_seqs=4,
        cpu=CpuOptions(isa=path),  # type: ignore[arg-type]
    ).resolve(model_max_positions=512)  # fmt: skip
    backend = TorchBackend(tiny_model_path("llama"), config)
    assert backend.kernel_path == path
    batch = backend.bind(4, 64, 0)
    prompts = {0: random_ids(12, seed=11), 2: random_ids(3, seed=12)}
    return run_greedy(backend, batch, prompts, num_new=6, chunk=5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_generation_is_the_same_on_every_path(path: str, dtype: str) -> None:
    got = _greedy(path, dtype)
    assert got == _greedy("none", dtype)
    assert all(len(tokens) == 6 for tokens in got.values())


@needs_compiler
def test_code_outside_the_isa_ifs_is_portable_c() -> None:
    """What a baseline x86-64 build compiles of csrc (the code every variant, neon included, shares) holds no x86
    intrinsics: they all sit inside the #if blocks of the AVX512/AMX parts. (No aarch64 cross compiler is needed
    to know the neon build sees only portable C and GCC builtins.)"""
    cc = cpu_build.compiler()
    assert cc is not None
    flags = ["-E", "-fopenmp", "-std=c11", *cpu_build.VARIANTS["x86_64"]["generic"][:1]]
    text = subprocess.run([*cc, *flags, "-I", str(cpu_build.CSRC), str(cpu_build.CSRC / cpu_build.SOURCE)],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    ours, current = [], ""
    for line in text.splitlines():
        if line.startswith("# "):  # a line marker: # N "file" flags
            current = line.split('"')[1] if '"' in line else current
        elif str(cpu_build.CSRC) in current:
            ours.append(line)
    assert len(ours) > 500  # the kernels' own code was found
    x86_only = re.compile(r"\b(_mm\w*|__m(128|256|512)\w*|__builtin_ia32\w*|__cpuid\w*|_tile_\w+)\b")
    assert [line for line in ours if x86_only.search(line)] == []
