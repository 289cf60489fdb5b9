"""A bf16 model's small quantized steps: the codes or the dense copies, timed at warm-up (quant_steps.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.models import fused_decode, quant, quant_steps
from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.engine.models.runner import SlotModelRunner
from nxdserve.errors import ConfigError
from tests.helpers.fused_runs import record_fused_runs
from tests.helpers.tiny_model import tiny_model_path

needs_fused = pytest.mark.skipif(not fused_decode.available(), reason="the fused bf16 C forward is not built here")


def _runner(dtype: torch.dtype = torch.bfloat16, method: str | None = "int8", slots: int = 4) -> SlotModelRunner:
    model = LlamaFamilyModel.from_pretrained(tiny_model_path("llama"), dtype, torch.device("cpu"), max_len=96)
    if method is not None:
        quant.quantize_model(model, method)
    return SlotModelRunner(model, slots, 96)


def _fused_steps(runner: SlotModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Runs a 1-row and a 3-row decode step; returns the sizes of those the fused forward ran."""
    sizes = record_fused_runs(monkeypatch)
    with torch.inference_mode():
        runner.run(torch.tensor([7]), np.array([0]), np.array([3]), np.array([1]))
        runner.run(torch.tensor([7, 8, 9]), np.arange(3), np.full(3, 3), np.ones(3, dtype=np.int64))
    return sizes


@needs_fused
def test_pinned_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _runner()
    assert _fused_steps(runner, monkeypatch) == []  # before any choice: the codes up to quant.dense_rows
    choice = quant_steps.choose_small_step_path(runner, "dense")
    assert choice is not None and choice.dense_above == 0 and choice.timings == ()
    assert _fused_steps(runner, monkeypatch) == [1, 3]
    choice = quant_steps.choose_small_step_path(runner, "codes")
    assert choice is not None and choice.dense_above == quant.dense_rows
    assert _fused_steps(runner, monkeypatch) == []


@needs_fused
@pytest.mark.parametrize(
    ("codes_ms", "dense_ms", "dense_above", "timed"),
    [
        ({1: 5.0, 4: 6.0}, {1: 9.0, 4: 7.0}, 16, [1, 4]),  # the codes win at every size timed: the layers' bound
        ({1: 5.0, 4: 9.0}, {1: 9.0, 4: 7.0}, 1, [1, 4]),  # the codes win at one row only
        ({1: 12.0, 4: 14.0}, {1: 9.0, 4: 7.0}, 0, [1]),  # the dense copies win at one row: every step reads them
        ({1: 250.0, 4: 900.0}, {1: 300.0, 4: 310.0}, 1, [1, 4]),  # slow steps: one timed run of each
    ],
)
def test_measured_choice_follows_the_timings(
    monkeypatch: pytest.MonkeyPatch,
    codes_ms: dict[int, float],
    dense_ms: dict[int, float],
    dense_above: int,
    timed: list[int],
) -> None:
    """The sizes timed are capped at the slots (4 here), smallest first, and stop at the first the codes lose;
    each path timed REPEATS times after a warm run (once where that run took over SLOW_STEP_S), the fastest
    counting; steps above the largest size where the codes won read the dense copies (above quant.dense_rows,
    16, where they won at every size timed)."""
    runner = _runner()
    calls: list[tuple[int, int | None]] = []
    fused = runner.model.fused_decode

    def fake_time(runner_: SlotModelRunner, rows: int, position: int) -> float:
        calls.append((rows, fused.quantized_dense_above))
        table = dense_ms if fused.quantized_dense_above == 0 else codes_ms
        return table[rows] / 1e3

    monkeypatch.setattr(quant_steps, "_time_step", fake_time)
    choice = quant_steps.choose_small_step_path(runner)
    assert choice is not None and choice.dense_above == dense_above
    assert fused.quantized_dense_above == dense_above
    assert [rows for rows, *_ in choice.timings] == timed
    assert sorted(set(calls)) == sorted((rows, above) for rows in timed for above in (0, quant.dense_rows))
    slow = min(codes_ms.values()) / 1e3 > quant_steps.SLOW_STEP_S
    assert len(calls) == len(timed) * 2 * (2 if slow else quant_steps.REPEATS + 1)
    assert "codes vs dense" in choice.describe()


@needs_fused
def test_measured_on_the_model_itself() -> None:
    """Without a stand-in clock: both paths are timed on the model and the choice is one of the sizes timed."""
    runner = _runner()
    choice = quant_steps.choose_small_step_path(runner)
    assert choice is not None and 1 <= len(choice.timings) <= 2
    assert all(codes > 0 and dense > 0 for _, codes, dense in choice.timings)
    assert choice.dense_above in (0, 1, quant.dense_rows)
    assert runner.model.fused_decode.quantized_dense_above == choice.dense_above


@pytest.mark.parametrize(("dtype", "method"), [(torch.float32, "int8"), (torch.bfloat16, None)])
def test_no_choice_without_a_bf16_quantized_model(dtype: torch.dtype, method: str | None) -> None:
    runner = _runner(dtype, method)
    assert quant_steps.choose_small_step_path(runner) is None
    assert runner.model.fused_decode.quantized_dense_above is None


def test_option_and_flag() -> None:
    from nxdserve.cli import build_parser, engine_config_from_args

    assert CpuOptions().quant_small_steps == "measure"
    args = build_parser().parse_args(["--cpu-quant-small-steps", "dense"])
    assert engine_config_from_args(args).cpu.quant_small_steps == "dense"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--cpu-quant-small-steps", "fast"])
    with pytest.raises(ConfigError, match="quant_small_steps"):
        CpuOptions(quant_small_steps="fast")  # type: ignore[arg-type]
