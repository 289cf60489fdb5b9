"""The quantized GEMM checked as a standalone program (tests/quant/qgemm_check.c against a float64 reference)
with each kernel variant's flags: natively for the variants this CPU runs, and, where an aarch64 cross compiler
and qemu-user are installed (``.ci/run`` installs them where apt can), the aarch64 builds under emulation. That is
how the NEON intrinsics are tested on x86 machines; their speed can only be measured on an ARM machine."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from nxdserve.engine.models import cpu_build

CHECK = Path(__file__).resolve().parents[1] / "quant" / "qgemm_check.c"
# best first (runnable_paths' order; "amx" is the avx512bf16 build)
HOST_VARIANTS = list(dict.fromkeys(v for p in cpu_build.runnable_paths() if (v := cpu_build.variant_of(p))))
CROSS_CC, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", Path("/usr/aarch64-linux-gnu")
needs_compiler = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler")
needs_cross = pytest.mark.skipif(
    cpu_build.machine() != "x86_64" or not (shutil.which(CROSS_CC) and shutil.which(QEMU) and SYSROOT.is_dir()),
    reason=f"needs {CROSS_CC} and {QEMU} (apt: gcc-aarch64-linux-gnu qemu-user) on an x86-64 machine",
)


def _build_check(cc: list[str], flags: list[str], out: Path) -> Path:
    cmd = [*cc, *cpu_build.COMPILE_FLAGS, *flags, "-I", str(cpu_build.CSRC), str(CHECK), "-o", str(out), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def _run_check(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok "), proc.stdout + proc.stderr


def _slow_but_first(variants: list[str]) -> list[object]:
    """The first variant in the default suite, the others (each a ~10 s compile of every kernel) marked slow."""
    return [v if i == 0 else pytest.param(v, marks=pytest.mark.slow) for i, v in enumerate(variants)]


@needs_compiler
@pytest.mark.parametrize("variant", _slow_but_first(HOST_VARIANTS))
def test_qgemm_matches_the_float64_reference_on_every_host_variant(variant: str, tmp_path: Path) -> None:
    cc = cpu_build.compiler()
    assert cc is not None
    _run_check([str(_build_check(cc, cpu_build.target_flags(variant), tmp_path / f"check-{variant}"))])


@needs_cross
@pytest.mark.parametrize("variant", _slow_but_first(list(cpu_build.VARIANTS["aarch64"])[::-1]))  # neon first
def test_aarch64_variants_build_with_werror_and_their_qgemm_runs_under_qemu(variant: str, tmp_path: Path) -> None:
    library = cpu_build.build_variant(variant, cc=[CROSS_CC], arch="aarch64", cache_dir=tmp_path)
    assert library.is_file()  # every kernel source compiles for aarch64 with -Werror and links
    flags = cpu_build.target_flags(variant, "aarch64")
    assert "-mtune=native" not in flags  # no native CPU of that kind to tune for
    program = _build_check([CROSS_CC], flags, tmp_path / f"check-{variant}")
    _run_check([QEMU, "-L", str(SYSROOT), str(program)])
