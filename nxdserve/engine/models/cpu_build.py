"""The build machinery of the C kernels (``nxdserve/csrc``): which ISA variants exist, which this CPU can run,
and the compile of one into the cache. Loading and dispatch: ``cpu_kernels``.

``csrc/kernels.c`` is compiled with the system C compiler (``$CC``, else ``cc``) into
``~/.cache/nxdserve/kernels``, keyed by the sources, flags, compiler version and variant, with explicit target
flags per variant (``VARIANTS``) rather than ``-march=native``, so one build serves every machine of its class:
``generic`` (the x86-64 / armv8-a baseline), ``avx2`` (x86-64-v3: AVX2, FMA, F16C), ``avx512bf16`` (x86-64-v4
plus AVX512-BF16/VNNI and the AMX code, which runs only where the CPU has AMX and the OS grants it) and ``neon``
(armv8.2-a with fp16 and dot product). At run time the best variant the CPU's flags allow (``runnable_paths``) is
loaded (``cpu_kernels.configure``; ``CpuOptions.isa`` can force a lower one or ``none``). OpenMP resolves to the
runtime torch already loaded (same soname), so the kernels share torch's threads and ``OMP_WAIT_POLICY``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCE = "kernels.c"  # includes the other parts: one translation unit (see its comment)

# Target flags per variant: the ISA explicit (a build runs on every CPU that has it), the tuning for the CPU that
# builds it (-mtune=native: the cache is per machine, and the CPU model is part of its key). Under -mtune=generic
# GCC vectorised the attention's softmax tail differently, so bf16 results moved by an ulp in rare rows (greedy
# bf16 text changed on a Zen 3 EPYC); tuned natively, the bits there are the old -march=native build's again.
# avx512bf16: x86-64-v4 (AVX512F/BW/CD/DQ/VL) plus the extensions the kernels test for (AVX512-BF16 and -VNNI,
# AMX-TILE/BF16/INT8), rather than -march=sapphirerapids: that would also allow AVX512-FP16 and AVX-VNNI, which
# AVX512-BF16 EPYCs (Zen 4) lack, and the kernels use neither. Every #if in the sources takes the branch it took
# under -march=native on those machines; the AMX code is compiled in for all of them and runs only where
# gemm_amx() finds the tiles and the OS permission (before, Zen 4 builds left it out).
# generic and avx2 add -fno-tree-loop-distribute-patterns: GCC turns the attention's fp32 row-copy loops into
# memcpy, which some tunings (generic) expand into 16-byte moves that the 32-byte loads right after cannot forward
# from (1.44x the attention's time on a Zen 3 EPYC); as loops they vectorise at the loads' width (0.65-0.74x of
# the -march=native build's time there). (The avx512bf16 build keeps GCC's default, as its machines built it.)
_PLAIN_LOOPS = "-fno-tree-loop-distribute-patterns"
VARIANTS: dict[str, dict[str, list[str]]] = {
    "x86_64": {
        "generic": ["-march=x86-64", "-mtune=native", _PLAIN_LOOPS],
        "avx2": ["-march=x86-64-v3", "-mtune=native", _PLAIN_LOOPS],
        "avx512bf16": [
            "-march=x86-64-v4",
            "-mavx512bf16",
            "-mavx512vnni",
            "-mamx-tile",
            "-mamx-bf16",
            "-mamx-int8",
            "-mtune=native",
        ],
    },
    "aarch64": {
        "generic": ["-march=armv8-a", "-mtune=native"],
        "neon": ["-march=armv8.2-a+fp16+dotprod", "-mtune=native"],
    },
}
# The /proc/cpuinfo flags each variant needs (x86-64-v3's are AVX2's set; abm is LZCNT).
_NEEDS: dict[str, frozenset[str]] = {
    "generic": frozenset(),
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}),
    "neon": frozenset({"asimd", "asimdhp", "asimddp"}),
}
_NEEDS["avx512bf16"] = _NEEDS["avx2"] | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16"}
_NEEDS["avx512bf16"] |= {"avx512_vnni"}
_AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})

# -ffast-math lets GCC vectorise exp (libmvec) and the fp32 sums; no inf/NaN reach the kernels' own
# arithmetic. It is given when compiling only: linked with it, GCC < 13 adds crtfastmath.o, whose
# constructor would switch the whole process to flush-denormals-to-zero when the library loads.
COMPILE_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11", "-Wall", "-Wextra", "-Werror"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]


def machine() -> str:
    arch = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``flags`` on x86, ``Features`` on aarch64), empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def runnable_paths(flags: frozenset[str] | None = None, arch: str | None = None) -> list[str]:
    """The kernel paths this CPU can run, best first, "none" last: a variant name, or "amx" (the avx512bf16
    build with the tiles, where the CPU has them; the OS permission is checked when the library loads)."""
    if arch is None and platform.system() != "Linux":  # the kernels use Linux's affinity calls
        return ["none"]
    flags = cpu_flags() if flags is None else flags
    variants = VARIANTS.get(arch or machine(), {})
    paths = [v for v in reversed(list(variants)) if _NEEDS[v] <= flags]
    if "avx512bf16" in paths and _AMX_FLAGS.issubset(flags):
        paths.insert(paths.index("avx512bf16"), "amx")
    return [*paths, "none"]


def variant_of(path: str) -> str | None:
    return None if path == "none" else "avx512bf16" if path == "amx" else path


def compiler() -> list[str] | None:
    """The C compiler command (``$CC``, else ``cc`` / ``gcc``), None when there is none."""
    cc = os.environ.get("CC")
    if cc:
        cmd = shlex.split(cc)
        return cmd if cmd and shutil.which(cmd[0]) else None
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _cpu_model() -> str:
    """What -mtune=native tunes for, as a cache key: the CPU's model line."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((ln for ln in lines if ln.startswith(("model name", "CPU part"))), "")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nxdserve" / "kernels"


def _sources() -> list[Path]:
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".h"))


def target_flags(variant: str, arch: str | None = None) -> list[str]:
    """The compiler flags of ``variant`` for ``arch`` (default: this machine's). For another architecture (a
    cross compiler) without ``-mtune=native``: there is no native CPU of that kind to tune for."""
    target = arch or machine()
    flags = VARIANTS.get(target, {}).get(variant)
    if flags is None:
        raise ValueError(f"unknown kernel variant {variant!r} for {target}")
    return flags if target == machine() else [f for f in flags if f != "-mtune=native"]


def build_variant(
    variant: str,
    cc: Sequence[str] | None = None,
    extra_flags: Sequence[str] = (),
    cache_dir: Path | None = None,
    arch: str | None = None,
) -> Path:
    """Compile ``variant`` (a key of ``VARIANTS[arch]``, this machine's by default; another ``arch`` needs its
    cross compiler as ``cc``) into the cache, or find it there; the path of the shared library. Raises
    RuntimeError with the compiler's message on failure. ``extra_flags`` go to both steps (sanitizers)."""
    cc = list(cc or compiler() or [])
    if not cc:
        raise RuntimeError("no C compiler")
    flags = target_flags(variant, arch)
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    compile_flags = [*COMPILE_FLAGS, *flags, *extra_flags]
    link_flags = [*LINK_FLAGS, *extra_flags]
    digest = hashlib.sha256()
    for part in [variant, " ".join(compile_flags), " ".join(link_flags), " ".join(cc), version, _cpu_model()]:
        digest.update(part.encode() + b"\0")
    for src in _sources():
        digest.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    target = (cache_dir or _cache_dir()) / f"kernels-{variant}-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, out = Path(tmp) / "kernels.o", Path(tmp) / target.name
        for cmd in (
            [*cc, *compile_flags, "-I", str(CSRC), "-c", str(CSRC / SOURCE), "-o", str(obj)],
            [*cc, str(obj), "-o", str(out), *link_flags],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cc)} failed for variant {variant}: {proc.stderr.strip()[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builds race harmlessly
    return target
