"""bf16 matrix multiplication through ``gemm_bf16`` (``csrc/gemm.c``): the weight packed once into panels.

``matmul(x, weight, bias, residual)`` returns None where the kernel does not apply (no AVX512-BF16
build, another dtype or device, autograd, non-contiguous rows); ``linear`` then takes oneDNN.
``CpuOptions.gemm`` turns it off (A/B measurements). Where the CPU has AMX-BF16, GEMMs whose K is a multiple
of 32 run on its tiles (``gemm.c``: the same packed panels), and read the weight's compressed copy
(``compress``: 12 bits a weight, lossless; the tiles see the same words), since at decode sizes a GEMM's time is
the time to read its weight from memory. ``CpuOptions.compressed_weights`` turns that off.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nxdserve.engine.models import cpu_kernels

PANEL = 48  # columns per panel: GM_NR in gemm.c
_ATTR = "_nxdserve_panels"
_CW_ATTR = "_nxdserve_compressed_panels"
CW_STEP_PAIRS = 16  # k pairs per compressed step: GM_AMX_STEP_PAIRS in gemm.c
CW_HEADER = 64

# Set from CpuOptions (cpu_setup.apply): the kernel on / off, and whether GEMMs on the tiles read the weights'
# compressed copy (``compress``; the bits are the same either way).
enabled = True
compression = True


def available() -> bool:
    return enabled and cpu_kernels.available() and cpu_kernels.built("gemm_available")


def uses_amx() -> bool:
    """Whether the GEMMs run on AMX tiles (Intel since Sapphire Rapids; ``CpuOptions.amx`` / ``isa``)."""
    lib = cpu_kernels._library()
    return available() and lib is not None and bool(lib.gemm_amx())


def kept(weight: torch.Tensor, attr: str, build: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``build(weight)``, made once and kept on the weight tensor, keyed by its version counter (an in-place
    update, such as loading, rebuilds it on the next call); modules sharing a weight share the copy."""
    entry = getattr(weight, attr, None)
    if entry is not None and entry[0] == weight._version:
        return entry[1]
    value = build(weight)
    setattr(weight, attr, (weight._version, value))
    return value


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (N, K) as (ceil(N/48), ceil(K/2), 48, 2): panels of 48 columns, k in pairs, zero-padded;
    kept on the weight (``kept``)."""
    return kept(weight, _ATTR, _pack)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    with torch.inference_mode():
        padded = F.pad(weight.detach(), (0, k % 2, 0, -n % PANEL))
        return padded.view(padded.shape[0] // PANEL, PANEL, padded.shape[1] // 2, 2).transpose(1, 2).contiguous()


def _cw_byte_order() -> torch.Tensor:
    """For each byte position b of a 64-word half group, the word j whose bytes sit there: the order in which
    ``_mm512_unpacklo_epi8`` / ``unpackhi`` (per 128-bit lane) put words 0-31 and 32-63 back together."""
    j = torch.arange(64)
    lane_of = torch.where(j < 32, j // 8, (j - 32) // 8)
    byte_of = 16 * lane_of + torch.where(j < 32, j % 8, 8 + (j - 32) % 8)
    return torch.argsort(byte_of)


def _align(n: int) -> int:
    return (n + 63) & ~63


def compress(weight: torch.Tensor) -> torch.Tensor | None:
    """``pack(weight)`` in 12 bits a word, losslessly (``gemm.c``, "Compressed panels"): a uint8 blob,
    kept on the weight like the packed copy. None where K is not a multiple of 32."""
    if weight.shape[1] % (2 * CW_STEP_PAIRS):
        return None
    return kept(weight, _CW_ATTR, _compress)


def _compress(weight: torch.Tensor) -> torch.Tensor:
    packed = pack(weight)
    panels, words = packed.shape[0], packed[0].numel()
    steps = weight.shape[1] // (2 * CW_STEP_PAIRS)
    step_words = CW_STEP_PAIRS * 2 * PANEL  # 1536: as GM_CW_WORDS
    groups = step_words // 128  # of 128 words: two 64-word halves, one code byte for both
    with torch.inference_mode():
        halves = packed.view(torch.uint8).view(panels, words, 2)  # each word's low byte, then its high byte
        # The 16 most common high bytes (sign and exponent >> 1) get a code each; zero padding is one of them
        # in a last partial panel. Code 16: outside the table, patched.
        table = torch.bincount(halves[..., 1].flatten(), minlength=256).topk(16).indices
        code_of = torch.full((256,), 16, dtype=torch.uint8)
        code_of[table] = torch.arange(16, dtype=torch.uint8)
        order = _cw_byte_order()
        data = torch.empty(panels, steps, step_words * 3 // 2, dtype=torch.uint8)
        counts, positions, values = [], [], []
        # A few panels at a time: the int64 indices of a whole LM head would be ~8x its size.
        for p0 in range(0, panels, 16):
            part = halves[p0 : p0 + 16]
            n = part.shape[0]
            codes = code_of[part[..., 1].long()]
            outside = codes == 16
            low = part[..., 0].reshape(n, steps, groups, 2, 64)[..., order]
            codes = codes.masked_fill(outside, 0).view(n, steps, groups, 2, 64)[..., order]
            data[p0 : p0 + n, :, :step_words] = low.reshape(n, steps, -1)
            data[p0 : p0 + n, :, step_words:] = (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(n, steps, -1)
            counts.append(outside.sum(1))
            panel_of, pos = outside.nonzero(as_tuple=True)
            positions.append(pos.to(torch.int32))  # < 2**31: a panel has K * 48 words
            values.append(packed[p0 : p0 + n].view(torch.int16).reshape(n, words)[panel_of, pos])
        patch_at = torch.zeros(panels + 1, dtype=torch.int32)
        patch_at[1:] = torch.cumsum(torch.cat(counts), 0).to(torch.int32)
        patch_pos, patch_val = torch.cat(positions), torch.cat(values)

        at_off = CW_HEADER + _align(data.numel())
        pos_off = at_off + _align(4 * (panels + 1))
        val_off = pos_off + _align(4 * patch_pos.numel())
        blob = torch.zeros(val_off + _align(2 * patch_val.numel()), dtype=torch.uint8)
        blob[:16] = table.to(torch.uint8)
        blob[16:40].view(torch.int64)[:] = torch.tensor([at_off, pos_off, val_off], dtype=torch.int64)
        blob[CW_HEADER : CW_HEADER + data.numel()] = data.flatten()
        blob[at_off : at_off + 4 * (panels + 1)].view(torch.int32)[:] = patch_at
        blob[pos_off : pos_off + 4 * patch_pos.numel()].view(torch.int32)[:] = patch_pos
        blob[val_off : val_off + 2 * patch_val.numel()].view(torch.int16)[:] = patch_val
    return blob


def compressed(weight: torch.Tensor) -> torch.Tensor | None:
    """``compress(weight)`` where the GEMMs would read it (compression on, AMX tiles), else None."""
    return compress(weight) if compression and uses_amx() else None


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
    blob = compressed(weight)
    args = cpu_kernels.GemmArgs(
        x.data_ptr(), m, k, x.stride(0), pack(weight).data_ptr(), None if blob is None else blob.data_ptr(),
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
        n, out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    lib.gemm_bf16(ctypes.byref(args))
    return out
