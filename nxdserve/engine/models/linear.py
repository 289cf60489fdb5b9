"""``linear(x, weight, bias, residual)``: ``F.linear`` (+ residual) through a packed weight on CPU.

``F.linear`` on a CPU bf16 weight runs oneDNN's brgemm matmul on the plain (out, in) layout, which
makes oneDNN reorder the weight into its blocked VNNI layout inside every call. For a decode step that
reorder is most of the work: measured on an AVX512-BF16 EPYC, prepacking once made batch-1 GEMVs
1.5-3x faster and batch-32 GEMMs 1.0-1.4x (the LM head 1.75x), with bit-identical results.

The packed copy is made lazily, on the first inference call, and stored on the weight tensor itself, so
modules that share a tensor (a truncated self-draft sharing the target's layers and LM head) share its
packed copy. It is keyed by the tensor's version counter: an in-place update of the weight (loading,
training an EAGLE head) makes it stale and it is rebuilt on the next call. Weights that require grad,
calls that record autograd, non-CPU tensors and dtypes oneDNN does not pack natively fall back to
``F.linear``. ``CpuOptions.packed_linear`` turns packing off (for A/B measurements).

Where the kernels are built for AVX512-BF16, bf16 weights go to ``gemm`` instead (its own packed layout,
faster than oneDNN at every row count a model runs: see ``csrc/gemm.c``); oneDNN is the fallback and no
oneDNN copy is made then.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from nxdserve.engine.models import gemm
from nxdserve.engine.models.quant import QuantLinear

_ATTR = "_nxdserve_packed"
_PACKED_DTYPES = (torch.bfloat16,)

enabled = True  # set from CpuOptions (cpu_setup.apply)


@functools.cache
def _available() -> bool:
    try:
        return bool(
            torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        )
    except (AttributeError, RuntimeError):
        return False


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of ``weight`` (out, in), kept on the weight like gemm's panels (``gemm.kept``),
    or None where packing does not apply."""
    if (
        not enabled
        or weight.requires_grad
        or weight.device.type != "cpu"
        or weight.dtype not in _PACKED_DTYPES
        or weight.dim() != 2
        or not _available()
    ):
        return None
    return gemm.kept(weight, _ATTR, _reorder_for_onednn)


def _reorder_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def drop_packed(weight: torch.Tensor) -> None:
    """Forget ``weight``'s packed copy (frees its memory; it is rebuilt on the next inference call)."""
    if hasattr(weight, _ATTR):
        delattr(weight, _ATTR)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | QuantLinear,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, plus ``residual`` when given (rounded as the eager ``out + residual``):
    through ``gemm`` or the packed oneDNN weight when there is no autograd to record; a quantized weight
    (``quant.QuantLinear``) through its own kernel."""
    if isinstance(weight, QuantLinear):
        x2 = x.reshape(-1, x.shape[-1])
        if bias is None:  # the residual added inside the kernel's store where it can
            res2 = None if residual is None else residual.reshape(-1, residual.shape[-1])
            return weight(x2, res2).view(*x.shape[:-1], weight.out_features)
        out = weight(x2).view(*x.shape[:-1], weight.out_features) + bias
        return out if residual is None else out + residual
    if not enabled or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        out = F.linear(x, weight, bias)
        return out if residual is None else out + residual
    lead = x.shape[:-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    res2 = None if residual is None else residual.reshape(-1, residual.shape[-1])
    fast = gemm.matmul(x2, weight, bias, res2)
    if fast is not None:
        out = fast
    else:
        out = _onednn_linear(x2, weight, bias)
        if res2 is not None:
            out = out + res2
    return out if x.dim() == 2 else out.view(*lead, out.shape[-1])


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = None if weight.is_inference() else packed_weight(weight)
    if packed is None or x.dtype != weight.dtype or x.device.type != "cpu" or x.numel() == 0:
        return F.linear(x, weight, bias)
    if bias is not None and (bias.dtype != weight.dtype or not bias.is_contiguous()):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
