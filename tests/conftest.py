"""Shared fixtures: engine cores on the default model (fp32 for exact comparisons)."""

from __future__ import annotations

import os
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
