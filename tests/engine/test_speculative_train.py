"""`nxdserve train-eagle` end to end on a tiny target: it trains, reports, saves both layouts, and the
engine serves the result losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from nxdserve.sampling_params import SamplingParams
from nxdserve.speculative.train_eagle import main
from tests.helpers.engine import PROMPTS, make_core, run_to_completion, tokenize
from tests.helpers.tiny_model import tiny_model_path


@pytest.mark.parametrize("nxd_layout", [False, True])
def test_train_eagle_cli_then_serve(tmp_path: Path, nxd_layout: bool, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(tiny_model_path("llama"))
    out = tmp_path / "head"
    argv = ["--model", model, "--out", str(out), "--num-prompts", "12", "--max-new-tokens", "12", "--epochs", "1",
            "--max-model-len", "128", "--gen-batch", "12", "--draft-vocab-size", "600", "--no-progress"]
    # The NxD run also checks a greedy-only corpus (no sampled copies).
    assert main([*argv, "--nxd-layout", "--sampled-copies", "0"] if nxd_layout else argv) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert json.loads(capsys.readouterr().out)["out"] == str(out)
    assert report["layout"] == ("nxd" if nxd_layout else "nxdserve")
    # 12 prompts: 1 held out (its greedy answer), 11 trained on, each with a greedy and a sampled answer.
    assert report["answers"] == {"train": 11 if nxd_layout else 22, "heldout": 1}
    assert 1.0 <= report["heldout_acceptance"]["mean_acceptance_length"] <= 4.0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) == nxd_layout and ("draft_vocab_ids" in names) != nxd_layout

    spec = {"method": "eagle", "model": str(out), "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    plain = make_core(model=model, max_model_len=128)
    core = make_core(model=model, max_model_len=128, speculative_config=spec)
    prompts = tokenize(plain, PROMPTS[:6])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in run_to_completion(plain, prompts, params)]
    got = [o.outputs[0].token_ids for o in run_to_completion(core, prompts, params)]
    assert got == expected


def test_bad_arguments_exit_with_usage() -> None:
    with pytest.raises(SystemExit) as info:
        main([])  # --out is required
    assert info.value.code == 2
