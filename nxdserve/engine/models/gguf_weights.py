"""A GGUF file's quantized linears served from its own blocks (``--quantization gguf``).

The 4-bit block formats map exactly onto ``quant.int4_from_codes``'s group-32 ``codes * scale + offset`` (the
nibbles kept in the file's byte order, which is the one the kernel reads):
Q4_0 (``d * (q - 8)``: scale d, offset -8d), Q4_1 (``d * q + m``: scale d, offset m) and Q4_K (each
sub-block of 32: scale ``d * sc``, offset ``-dmin * m``); the codes are the file's nibbles, unchanged.
Q8_0 (``d * q`` per 32) keeps its int8 codes and block scales (``QuantLinear`` kind ``"q8_0"``, read by the
``q8`` kernel of ``csrc/qgemm.c``; no PyTorch kernel takes per-block int8 scales, so without our kernels, or for
many rows, it is expanded once into the compute dtype). Other tensor types (F32 norms) are not linears here and
come from the dense folder as before.

llama.cpp's converter permutes the rows of attn_q / attn_k for its RoPE layout; the rows are put back as
transformers does when it loads a GGUF (``_reverse_permute``), which moves whole rows, so whole blocks.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from nxdserve.engine.models.quant import QuantLinear, int4_from_codes
from nxdserve.errors import ConfigError

BLOCK = 32
_PARTS = {  # GGUF name in blk.N -> (our fused attribute, its position among the fused parts)
    "attn_q": ("qkv_weight", 0), "attn_k": ("qkv_weight", 1), "attn_v": ("qkv_weight", 2),
    "attn_output": ("o_weight", 0), "ffn_gate": ("gate_up_weight", 0), "ffn_up": ("gate_up_weight", 1),
    "ffn_down": ("down_weight", 0),
}  # fmt: skip


def _f16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) codes: low nibbles are elements 0-15, high nibbles 16-31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def decode_4bit(kind: str, raw: np.ndarray, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit GGUF tensor's bytes (rows, bytes) -> codes (rows, cols) int32, scale and offset (rows, cols/32)."""
    rows = raw.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        blocks = raw.reshape(rows, cols // BLOCK, size)
        d = _f16(blocks[..., 0:2]).squeeze(-1)
        codes = _nibbles(blocks[..., size - 16 :])
        offset = -8.0 * d if kind == "Q4_0" else _f16(blocks[..., 2:4]).squeeze(-1)
        return torch.from_numpy(codes.reshape(rows, cols).astype(np.int32)), d, offset
    if kind == "Q4_K":
        blocks = raw.reshape(rows, cols // 256, 144)
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # (rows, nb, 1)
        s = blocks[..., 4:16].astype(np.int32)
        sc = np.concatenate((s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)), axis=-1)
        mn = np.concatenate((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)), axis=-1)
        qs = blocks[..., 16:].reshape(rows, cols // 256, 4, 32)  # 4 chunks of 64 values: low, then high nibbles
        codes = np.stack((qs & 0x0F, qs >> 4), axis=3).reshape(rows, cols)
        scale = (d * torch.from_numpy(sc).float()).reshape(rows, -1)
        offset = (-dmin * torch.from_numpy(mn).float()).reshape(rows, -1)
        return torch.from_numpy(codes.astype(np.int32)), scale, offset
    raise ConfigError(f"GGUF tensor type {kind} is not a 4-bit format served quantized")


def decode_q8_0(raw: np.ndarray, cols: int) -> QuantLinear:
    rows = raw.shape[0]
    blocks = raw.reshape(rows, cols // BLOCK, 34)
    d = _f16(blocks[..., 0:2]).squeeze(-1)
    codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols))
    return QuantLinear("q8_0", rows, cols, codes.contiguous(), d.contiguous(), group=BLOCK, padded_in=cols)


def _reverse_permute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """The row order transformers restores for a GGUF's attn_q / attn_k (heads: q heads / kv heads)."""
    index = torch.arange(rows.shape[0])
    dim = rows.shape[0] // heads // 2
    return rows[index.view(heads, dim, 2).transpose(1, 2).reshape(-1)]


def load_quantized_linears(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, QuantLinear]:
    """``{"layers.{i}.{attr}" | "lm_head": QuantLinear}`` for every linear the file holds in a served format.
    Kept per process by the file's identity (the default model is served from its blocks by default, and
    reading them takes seconds, most of it the reader parsing the tokenizer's metadata): engines built on the
    same file share the ``QuantLinear``s, which nothing changes after they are made."""
    stat = path.stat()
    return dict(_cached_linears(str(path.resolve()), stat.st_size, stat.st_mtime_ns, num_heads, num_kv_heads))


@functools.lru_cache(maxsize=2)
def _cached_linears(path: str, _size: int, _mtime_ns: int, num_heads: int, num_kv_heads: int) -> dict[str, QuantLinear]:
    return _read_quantized_linears(Path(path), num_heads, num_kv_heads)


def _read_quantized_linears(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, QuantLinear]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    parts: dict[str, dict[int, tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    out: dict[str, QuantLinear] = {}
    kinds: dict[str, str] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        name = tensor.name.removesuffix(".weight")
        raw = np.asarray(tensor.data)
        cols = int(tensor.shape[0])  # GGUF lists dims innermost first
        if name in ("token_embd", "output") and kind in ("Q8_0", "Q4_0", "Q4_1", "Q4_K"):
            if name == "output" or "output" not in kinds:
                out["lm_head"] = decode_q8_0(raw, cols) if kind == "Q8_0" else int4_from_codes(
                    *decode_4bit(kind, raw, cols), BLOCK, cols
                )
            kinds[name] = kind
            continue
        pieces = name.split(".")
        if len(pieces) != 3 or pieces[0] != "blk" or pieces[2] not in _PARTS:
            continue
        if kind not in ("Q4_0", "Q4_1", "Q4_K"):
            raise ConfigError(f"--quantization gguf: {tensor.name} is {kind}; served quantized: Q4_0, Q4_1, Q4_K "
                              "(Q8_0 for the embedding / head); use --dtype for a dense copy")  # fmt: skip
        codes, scale, offset = decode_4bit(kind, raw, cols)
        if pieces[2] in ("attn_q", "attn_k"):
            heads = num_heads if pieces[2] == "attn_q" else num_kv_heads
            codes, scale, offset = (_reverse_permute(t, heads) for t in (codes, scale, offset))
        attr, position = _PARTS[pieces[2]]
        parts.setdefault(f"layers.{pieces[1]}.{attr}", {})[position] = (kind, codes, scale, offset)
    for key, by_position in parts.items():
        ordered = [by_position[i] for i in sorted(by_position)]
        codes, scale, offset = (torch.cat([part[1] for part in ordered]), torch.cat([part[2] for part in ordered]),
                                torch.cat([part[3] for part in ordered]))
        out[key] = int4_from_codes(codes, scale, offset, BLOCK, codes.shape[1])
    return out
