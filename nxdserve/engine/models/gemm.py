"""bf16 matrix multiplication through ``gemm_source.gemm_bf16``: the weight packed once into panels.

``matmul(x, weight, bias, residual)`` returns None where the kernel does not apply (no AVX512-BF16
build, another dtype or device, autograd, non-contiguous rows); ``linear`` then takes oneDNN.
``NXDSERVE_GEMM=0`` turns it off (A/B measurements). Where the CPU has AMX-BF16, GEMMs whose K is a multiple
of 32 run on its tiles (``gemm_source``: the same packed panels).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from nxdserve.engine.models import cpu_kernels

PANEL = 48  # columns per panel: GM_NR in gemm_source
_ATTR = "_nxdserve_panels"

enabled = os.environ.get("NXDSERVE_GEMM", "1") != "0"


def available() -> bool:
    return enabled and cpu_kernels.available() and cpu_kernels.built("gemm_available")


def uses_amx() -> bool:
    """Whether the GEMMs run on AMX tiles (Intel since Sapphire Rapids; ``NXDSERVE_AMX=0`` turns it off)."""
    lib = cpu_kernels._library()
    return available() and lib is not None and bool(lib.gemm_amx())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (N, K) as (ceil(N/48), ceil(K/2), 48, 2): panels of 48 columns, k in pairs, zero-padded.
    Made once and kept on the weight tensor, keyed by its version counter (an in-place update, such as
    loading, repacks on the next call); modules sharing a weight share the copy."""
    entry = getattr(weight, _ATTR, None)
    if entry is not None and entry[0] == weight._version:
        return entry[1]
    n, k = weight.shape
    with torch.inference_mode():
        padded = F.pad(weight.detach(), (0, k % 2, 0, -n % PANEL))
        packed = padded.view(padded.shape[0] // PANEL, PANEL, padded.shape[1] // 2, 2).transpose(1, 2).contiguous()
    setattr(weight, _ATTR, (weight._version, packed))
    return packed


def _rows(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and t.dtype == torch.bfloat16 and t.device.type == "cpu"


def matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``bf16(x @ weight.T + bias)``, then ``+ residual`` rounded again; x (M, K). None where not applicable."""
    if (
        not _rows(x)
        or not _rows(weight)
        or not weight.is_contiguous()
        or weight.shape[1] != x.shape[1]
        or weight.requires_grad
        or weight.is_inference()  # no version counter to key the packed copy on
        or x.requires_grad
        or x.shape[0] == 0
        or (bias is not None and not (_rows(bias[None]) and bias.is_contiguous()))
        or (residual is not None and (not _rows(residual) or residual.shape != (x.shape[0], weight.shape[0])))
        or not available()
    ):
        return None
    lib = cpu_kernels._library()
    assert lib is not None
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    lib.gemm_bf16(
        x.data_ptr(), m, k, x.stride(0), pack(weight).data_ptr(), None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
        n, out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    return out
