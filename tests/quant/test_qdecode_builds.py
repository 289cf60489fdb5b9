"""The fused quantized forward (csrc/qdecode.c) against the layer path made of the library's own per-op kernels, as
a standalone C program (qdecode_check.c) built with each kernel variant's flags: the variants this CPU runs, and
the aarch64 ones under qemu-user where a cross compiler and qemu are installed (no x86 machine loads them)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from nxdserve.engine.models import cpu_build

CHECK = Path(__file__).resolve().parent / "qdecode_check.c"
NATIVE = [cpu_build.variant_of(p) for p in cpu_build.runnable_paths() if p not in ("none", "amx")]
CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"


def _build_and_run(cc: list[str], flags: list[str], tmp_path: Path, runner: list[str]) -> str:
    exe = tmp_path / "qdecode_check"
    cmd = [*cc, *cpu_build.COMPILE_FLAGS, *flags, "-I", str(cpu_build.CSRC), str(CHECK), "-o", str(exe), "-lm"]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
    return run.stdout


@pytest.mark.slow  # a build of all of kernels.c per variant
@pytest.mark.parametrize("variant", NATIVE)
def test_fused_forward_equals_the_per_op_kernels_native(variant: str, tmp_path: Path) -> None:
    cc = cpu_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    flags = next(v[variant] for v in cpu_build.VARIANTS.values() if variant in v)
    _build_and_run(cc, flags, tmp_path, [])


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(cpu_build.VARIANTS["aarch64"]))
def test_fused_forward_equals_the_per_op_kernels_aarch64_under_qemu(variant: str, tmp_path: Path) -> None:
    if shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None:
        pytest.skip(f"needs {CROSS_CC} and {QEMU}")
    flags = [f for f in cpu_build.VARIANTS["aarch64"][variant] if f != "-mtune=native"]
    _build_and_run([CROSS_CC], [*flags, "-static"], tmp_path, [QEMU])
