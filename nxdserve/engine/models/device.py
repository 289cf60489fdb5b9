"""Device and dtype choice for the torch backend."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from nxdserve.errors import ConfigError

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} was asked for but CUDA is not available.")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"Unknown device {name!r}.") from exc


# C-kernel builds that, forced with --cpu-isa, stand for a CPU without native bf16 (an AVX2-only x86, or one
# without AVX2): "auto" then picks that CPU's dtype, so a forced run measures what such a machine serves.
NO_BF16_ISAS = ("avx2", "generic")


def resolve_dtype(name: str, device: torch.device, cpu_isa: str = "auto") -> torch.dtype:
    """``auto``: bf16 on CUDA with bf16 support and on CPUs with native bf16 (AVX512-BF16 / AMX), else fp32;
    fp32 too where ``cpu_isa`` (``--cpu-isa``) forces a build in ``NO_BF16_ISAS``."""
    if name != "auto":
        if name not in _DTYPES:
            raise ConfigError(f"Unknown dtype {name!r} (auto, float32, bfloat16 or float16).")
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() and cpu_isa not in NO_BF16_ISAS else torch.float32


@functools.cache
def cpu_has_fast_bf16() -> bool:
    # oneDNN emulates bf16 on plain AVX512 and AVX2, which is slower than fp32; only native bf16
    # instructions pay off (measured on an AVX512-BF16 EPYC: bf16 GEMMs 1.3-3x faster than fp32).
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        return False
    flags = _cpu_flags()
    if flags is None:  # not Linux: trust oneDNN's own check
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def _cpu_flags() -> set[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None
