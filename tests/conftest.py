"""Shared fixtures: engine cores on the default model (fp32 for exact comparisons)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see nxdserve/__init__.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def exact_kernels() -> Iterator[None]:
    """Quantized linears get the model's own (fp32) activations where PyTorch's weight-only kernels run (they
    take bf16 by default, ``quant.kernel_dtype``): every path then computes the codes exactly in fp32."""
    from nxdserve.engine.models import quant

    saved = quant.kernel_dtype
    quant.kernel_dtype = None
    yield
    quant.kernel_dtype = saved


@pytest.fixture(autouse=True)
def default_cpu_options_afterwards() -> Iterator[None]:
    """A test whose core was built with other ``CpuOptions`` (a forced ``--cpu-isa``, a switch off) leaves them
    applied process-wide; the defaults go back after it, so a later test that builds no core of its own (an EAGLE
    head, a bare model) runs on this machine's own path."""
    yield
    setup = sys.modules.get("nxdserve.engine.models.cpu_setup")
    if setup is not None:
        from nxdserve.cpu_options import CpuOptions

        if setup.applied is not None and setup.applied != CpuOptions():
            setup.apply(CpuOptions())

