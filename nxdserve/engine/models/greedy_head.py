"""Greedy tokens straight from the LM head, without its logits: ``argmax(bf16(hidden @ W.T))``, the same
indices as the full head (first maximum), on AVX512-VNNI CPUs. Measured on SmolLM2: 3.5 vs 5.0 ms at 32 rows,
0.4 vs 1.3 ms at one.

The screen (``csrc/greedy_head.c``) runs the head in int8 with a proven error bound per logit and computes
again in bf16 only the columns that can still be the maximum. Its int8 copy of the head (~28 MB for
SmolLM2, 0.35 s to pack) is made on first use, which the torch backend's warm-up triggers; the few outlier
channels of the final hidden state that stay in bf16 are the largest ones of that first batch (a poor
choice costs speed, never a wrong index: measured on SmolLM2, a warm-up prompt of arbitrary token ids
doubles the columns recomputed against calibrating on served traffic, ~1% of the head).
``CpuOptions.greedy_head`` turns it off (A/B measurements).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nxdserve.engine.models import cpu_kernels, gemm

NUM_OUTLIERS = 16  # hidden channels kept in bf16 (even)
MAX_ROWS = 64  # rows per kernel call (bounds the candidate lists' scratch)
# The screen pays for itself while it recomputes a small part of the head. A model whose logits are too flat
# for it (measured: random weights make it 4x slower than the full head) turns it off after a few calls.
POOR_FRACTION = 0.1
POOR_CALLS = 8
_SLACK = 1.0 + 2.0**-8  # see the bound in greedy_head.c

enabled = True  # set from CpuOptions (cpu_setup.apply)
logger = logging.getLogger(__name__)


def built() -> bool:
    """Whether the screen's kernel exists here (AVX512-VNNI and BF16)."""
    return gemm.available() and cpu_kernels.built("greedy_head_available")


def available() -> bool:
    return enabled and built()


@dataclass
class _Screen:
    vocab: int
    version: int
    rest: torch.Tensor  # (KR,) int32 channels quantized to int8
    outliers: torch.Tensor  # (KS,) int32 channels kept in bf16
    wq: torch.Tensor  # (P, ceil(KR/4), 48, 4) int8
    ws: torch.Tensor  # (P, KS/2, 48, 2) bf16
    # Per column, (P*48,) float32 with the bound's slack (see greedy_head.c):
    sw: torch.Tensor  # the int8 scale s_w
    swb: torch.Tensor  # s_w ||c||_1 / 2
    swc2: torch.Tensor  # s_w ||c||_2
    dw: torch.Tensor  # ||w_R - s_w c||_2
    l2: torch.Tensor  # ||w||_2
    csum: torch.Tensor  # (P*48,) int32 sum of the column's int8 values c
    pointers: torch.Tensor  # the five float columns' addresses, in that order (gh_cols)


def _pack(weight: torch.Tensor, calibration: torch.Tensor, vocab: int) -> _Screen:
    n, k = vocab, weight.shape[1]
    num_out = min(NUM_OUTLIERS, k - k % 2)
    peak = calibration.float().abs().amax(dim=0)
    outliers = peak.topk(num_out).indices.sort().values
    keep = torch.ones(k, dtype=torch.bool)
    keep[outliers] = False
    rest = keep.nonzero().flatten()
    w = weight[:vocab].detach()
    wr = w[:, rest].float()
    sw = wr.abs().amax(dim=1) / 127.0
    sw[sw == 0] = 1.0
    q = torch.round(wr / sw[:, None]).clamp_(-127, 127)
    pad_n = -n % gemm.PANEL
    kr = rest.numel()
    q8 = F.pad(q.to(torch.int8), (0, -kr % 4, 0, pad_n))
    panels = q8.shape[0] // gemm.PANEL
    wq = q8.view(panels, gemm.PANEL, q8.shape[1] // 4, 4).transpose(1, 2).contiguous()
    ws = F.pad(w[:, outliers], (0, 0, 0, pad_n))
    ws = ws.view(panels, gemm.PANEL, num_out // 2, 2).transpose(1, 2).contiguous()

    def column(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.pad(v, (0, pad_n)).to(dtype).contiguous()

    # fp32 norms: their relative error (~K 2^-24) is far inside the slack.
    floats = {
        "sw": sw,
        "swb": sw * q.abs().sum(dim=1) * 0.5 * _SLACK,
        "swc2": sw * q.norm(dim=1) * _SLACK,
        "dw": (wr - sw[:, None] * q).norm(dim=1) * _SLACK,
        "l2": w.float().norm(dim=1) * _SLACK,
    }
    cols = {name: column(v, torch.float32) for name, v in floats.items()}
    return _Screen(
        vocab=vocab,
        version=weight._version,
        rest=rest.to(torch.int32),
        outliers=outliers.to(torch.int32),
        wq=wq,
        ws=ws,
        **cols,
        csum=column(q.sum(dim=1), torch.int32),
        pointers=torch.tensor([cols[name].data_ptr() for name in floats], dtype=torch.int64),
    )


class GreedyHead:
    """``argmax`` of an LM head's bf16 logits for greedy rows. ``weight`` (V, K) bf16, as the head uses it."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self._screen: _Screen | None = None
        self._scratch: dict[str, torch.Tensor] = {}
        self.last_recomputed = 0  # columns computed again in bf16 by the last call (a measure of the screen)
        self.disabled = False
        self._poor_calls = 0

    def usable(self, hidden: torch.Tensor) -> bool:
        w = self.weight
        return (
            available()
            and hidden.dim() == 2
            and hidden.dtype == torch.bfloat16 == w.dtype
            and hidden.device.type == "cpu" == w.device.type
            and hidden.shape[1] == w.shape[1]
            and hidden.stride(1) == 1
            and w.is_contiguous()
            and not w.is_inference()
        )

    def argmax(self, hidden: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """(M,) int64 token ids over the first ``vocab`` columns, or None where the screen cannot run (the
        caller takes the full head): unsupported tensors, or a row that is not finite."""
        if self.disabled or hidden.shape[0] == 0 or not self.usable(hidden) or not 0 < vocab <= self.weight.shape[0]:
            return None
        screen = self._screen
        if screen is None or screen.vocab != vocab or screen.version != self.weight._version:
            screen = self._screen = _pack(self.weight, hidden, vocab)
        out = torch.empty(hidden.shape[0], dtype=torch.long)
        recomputed = 0
        for m0 in range(0, hidden.shape[0], MAX_ROWS):
            rows = hidden[m0 : m0 + MAX_ROWS]
            got = self._call(screen, rows, out[m0 : m0 + rows.shape[0]])
            if got < 0:
                return None
            recomputed += got
        self.last_recomputed = recomputed
        self._poor_calls = self._poor_calls + 1 if recomputed > POOR_FRACTION * hidden.shape[0] * vocab else 0
        if self._poor_calls >= POOR_CALLS:
            self.disabled = True
            logger.info("greedy LM-head screen off: recomputed %d of %d columns", recomputed, hidden.shape[0] * vocab)
        return out

    def _buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[name] = torch.empty(numel, dtype=dtype)
        return buf

    def _call(self, s: _Screen, x: torch.Tensor, out: torch.Tensor) -> int:
        lib = cpu_kernels._library()
        assert lib is not None
        m, k = x.shape
        threads = torch.get_num_threads()
        kq = 4 * ((s.rest.numel() + 3) // 4)
        lists = threads * m * s.vocab
        scratch = (
            self._buffer("xq", m * kq, torch.uint8),
            self._buffer("xs", m * s.outliers.numel(), torch.bfloat16),
            self._buffer("rows", 5 * m, torch.float32),
            self._buffer("idx", lists, torch.int32),
            self._buffer("hi", lists, torch.float32),
        )
        args = cpu_kernels.GreedyHeadArgs(
            x.data_ptr(), m, k, x.stride(0), s.rest.data_ptr(), s.rest.numel(), s.outliers.data_ptr(),
            s.outliers.numel(), s.wq.data_ptr(), s.ws.data_ptr(), s.pointers.data_ptr(), s.csum.data_ptr(),
            gemm.pack(self.weight).data_ptr(), s.vocab, out.data_ptr(), *(b.data_ptr() for b in scratch), threads,
        )  # fmt: skip
        got = lib.greedy_head_argmax(ctypes.byref(args))
        return int(got)
