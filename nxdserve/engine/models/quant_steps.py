"""Which path a bf16 model's small quantized steps take: the codes or the dense copies, measured at warm-up.

A bf16 model served with quantized linears (``--quantization int8 | int4 | fp8 | gguf`` where the fused
AVX512-BF16 / AMX forward runs) multiplies a step of more than ``quant.dense_rows`` tokens by each linear's dense
bf16 copy, in one fused call (``fused_decode.py``); a smaller step runs layer by layer on the codes, reading fewer
bytes but paying Python and a kernel call per linear. Which one wins depends on the model and the machine: where
the dense weights stream from memory the codes win at one row (a 1.07B Llama on AMX, 4-bit: 0.72x the dense
time), where they sit in the last-level cache the fused dense forward wins at every size (SmolLM2-135M on the
same machine, int8: 0.54x the codes' time at one row, 0.39x at 16). So the torch backend times both at warm-up,
on the model itself, and the steps take the faster one (``CpuOptions.quant_small_steps``: ``codes`` / ``dense``
pin a path). The dense copies exist either way once any step of more than ``quant.dense_rows`` tokens has run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from nxdserve.engine.models import quant
from nxdserve.engine.models.quant import QuantLinear
from nxdserve.engine.models.runner import SlotModelRunner

logger = logging.getLogger(__name__)

# Step sizes timed (capped at the slots and quant.dense_rows), and the timed runs of each path at each size
# (the fastest counts: interleaved, so a burst of load hits both paths alike).
SIZES = (1, 4, 16)
REPEATS = 3
SLOW_STEP_S = 0.2  # a warm run slower than this: one timed run of each path at that size


@dataclass(frozen=True)
class SmallStepChoice:
    dense_above: int  # steps of more tokens than this read the dense copies
    # (tokens, codes seconds, dense seconds) per size timed; empty where a mode pinned the path
    timings: tuple[tuple[int, float, float], ...] = ()

    def describe(self) -> str:
        path = "dense bf16 copies" if self.dense_above == 0 else f"codes up to {self.dense_above} rows, then dense"
        times = ", ".join(f"{n} rows {1e3 * c:.1f} vs {1e3 * d:.1f} ms" for n, c, d in self.timings)
        return f"{path} ({'codes vs dense: ' + times if times else 'pinned'})"


def _eligible(runner: SlotModelRunner) -> bool:
    """A bf16 model with quantized linears whose fused forward would read the dense copies of a one-token step."""
    model = runner.model
    fused = model.fused_decode
    if not quant.dense_rows or not isinstance(model.layers[0].qkv_weight, QuantLinear):
        return False
    meta = runner.metadata(np.array([0]), np.array([0]), np.array([1]))
    saved = fused.quantized_dense_above
    fused.quantized_dense_above = 0
    try:
        return fused.accepts(torch.zeros(1, dtype=torch.long), meta, runner.kv_cache)
    finally:
        fused.quantized_dense_above = saved


def _time_step(runner: SlotModelRunner, rows: int, position: int) -> float:
    slots = np.arange(rows)
    started = time.perf_counter()
    runner.run(torch.zeros(rows, dtype=torch.long), slots, np.full(rows, position), np.ones(rows, dtype=np.int64))
    return time.perf_counter() - started


def choose_small_step_path(runner: SlotModelRunner, mode: str = "measure") -> SmallStepChoice | None:
    """Set ``runner.model.fused_decode.quantized_dense_above`` by ``mode`` (``measure`` | ``codes`` | ``dense``);
    None where the model has no such choice. Measuring writes K/V at one position of the first slots: call it
    before any request holds a slot (the torch backend's warm-up)."""
    with torch.inference_mode():  # as steps run (the fused forward declines autograd)
        return _choose(runner, mode)


def _choose(runner: SlotModelRunner, mode: str) -> SmallStepChoice | None:
    if not _eligible(runner):
        return None
    fused = runner.model.fused_decode
    if mode != "measure":
        choice = SmallStepChoice(0 if mode == "dense" else quant.dense_rows)
        fused.quantized_dense_above = choice.dense_above
        return choice
    position = min(32, runner.max_len - 1)
    sizes = sorted({min(n, runner.num_slots, quant.dense_rows) for n in SIZES})
    timings = []
    dense_above = 0
    for rows in sizes:
        best = {0: float("inf"), quant.dense_rows: float("inf")}  # dense_above -> fastest seconds
        repeats = REPEATS
        for repeat in range(REPEATS + 1):
            if repeat > repeats:
                break
            for above in best:
                fused.quantized_dense_above = above
                seconds = _time_step(runner, rows, position)
                if repeat:  # the first run of each path warms its kernels and copies up
                    best[above] = min(best[above], seconds)
                elif seconds > SLOW_STEP_S:  # a large model: one timed run each bounds the start-up cost
                    repeats = 1
        codes, dense = best[quant.dense_rows], best[0]
        timings.append((rows, codes, dense))
        # Steps above the largest size where the codes won read the dense copies (every step, if they never won).
        # The codes' cost grows with the rows, the dense forward's hardly: once they lose, larger sizes are not timed.
        if codes >= dense:
            break
        dense_above = rows
    else:  # the codes won at every size timed (capped at the slots): the layers' own bound, as before
        dense_above = quant.dense_rows
    choice = SmallStepChoice(dense_above, tuple(timings))
    fused.quantized_dense_above = dense_above
    return choice
