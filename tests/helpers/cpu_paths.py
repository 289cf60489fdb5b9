"""Running a test on one forced CPU kernel path (``CpuOptions.isa``), the default options restored after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.models import cpu_kernels, cpu_setup


@contextmanager
def forced_cpu_path(isa: str, **options: Any) -> Iterator[str]:
    """Apply ``CpuOptions(isa=isa, **options)``, checking that the kernel path really runs (a variant that did
    not build would silently fall back to torch ops), then restore the defaults."""
    assert cpu_setup.apply(CpuOptions(isa=isa, **options)) == isa
    if isa != "none":
        assert cpu_kernels.active_path() == isa, "the variant did not build (see the log)"
    try:
        yield isa
    finally:
        cpu_setup.apply(CpuOptions())
