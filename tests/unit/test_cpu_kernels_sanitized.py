"""The kernel tests again, on a build with AddressSanitizer and UndefinedBehaviorSanitizer (slow: a fresh build
of each variant and a subprocess with libasan preloaded). Any sanitizer report fails it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nxdserve.engine.models import cpu_build

ROOT = Path(__file__).resolve().parents[2]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
# Every test of the kernels; on this CPU's paths those of AVX512-only parts skip themselves.
KERNEL_TESTS = [
    "tests/unit/test_cpu_kernels.py",
    "tests/unit/test_cpu_isa.py::test_kernels_match_torch_on_every_path",
    "tests/unit/test_cpu_isa.py::test_greedy_generation_is_the_same_on_every_path",
    "tests/unit/test_cpu_threads.py",
    "tests/unit/test_gemm.py",
    "tests/unit/test_fused_decode.py",
    "tests/unit/test_greedy_head.py",
    "tests/lora/test_lora_kernel.py",
    "tests/quant/test_qgemm_i8.py::test_int8_activations_compute_the_rounded_product_and_stay_within_its_bound",
    "tests/quant/test_fused_qdecode.py::test_fused_step_equals_the_layer_path",
    "tests/quant/test_fused_qdecode.py::test_fused_step_on_three_threads_equals_the_layer_path",
    "tests/quant/test_fused_qdecode.py::test_fused_step_covers_biases_windows_and_head_shapes",
    "tests/quant/test_fused_qdecode.py::test_fused_step_on_an_fp8_cache_equals_the_layer_path",
    "tests/unit/test_fused_layer_tables.py",
]
RUNNER = """
import sys
from nxdserve.engine.models import cpu_kernels
cpu_kernels.set_extra_build_flags(sys.argv[1].split())
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[2:]]))
"""


@pytest.mark.slow
def test_kernel_tests_pass_under_asan_and_ubsan(tmp_path: Path) -> None:
    cc = cpu_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    libasan = subprocess.run([*cc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(libasan):
        pytest.skip(f"{cc[0]} has no libasan")
    env = {
        **os.environ,
        "LD_PRELOAD": libasan,  # first in the process: Python itself is not instrumented
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",  # CPython's own allocations look like leaks
        "UBSAN_OPTIONS": "print_stacktrace=1",
        "XDG_CACHE_HOME": str(tmp_path),  # the sanitized builds apart from the normal ones
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, " ".join(SANITIZE), *KERNEL_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    built = sorted(p.name for p in (tmp_path / "nxdserve" / "kernels").glob("kernels-*.so"))
    assert built, f"no sanitized build was made:\n{output[-4000:]}"
    assert "Sanitizer" not in output and "runtime error:" not in output, output[-8000:]
    assert proc.returncode == 0, output[-8000:]
