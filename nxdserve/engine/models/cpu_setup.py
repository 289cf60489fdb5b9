"""Applies ``CpuOptions`` to the CPU forward's modules, once, when the torch backend is built."""

from __future__ import annotations

from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.models import (
    cpu_kernels,
    fused_decode,
    fused_qdecode,
    gemm,
    greedy_head,
    huge_pages,
    linear,
    quant,
)

# The options last applied (process-wide, as the switches are); None before the first call.
applied: CpuOptions | None = None


def apply(options: CpuOptions) -> str:
    """Set every switch from ``options``; returns the C kernels' path (``cpu_kernels.configure``). Raises
    ConfigError for an ISA this CPU cannot run."""
    global applied
    path = cpu_kernels.configure(options.isa, options.amx)
    applied = options
    gemm.enabled = options.gemm
    gemm.compression = options.compressed_weights
    fused_decode.enabled = options.fused_decode
    fused_qdecode.enabled = options.fused_quant_decode
    greedy_head.enabled = options.greedy_head
    linear.enabled = options.packed_linear
    huge_pages.enabled = options.kv_huge_pages
    quant.dense_rows = options.quant_dense_rows
    quant.int8_activations = options.quant_int8_activations
    return path
