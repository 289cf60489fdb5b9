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


def _assert_served_losslessly(model: str, head: Path, num_speculative_tokens: int, num_prompts: int) -> None:
    """Greedy output with the head drafting equals greedy output without speculation."""
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": num_speculative_tokens,
            "disable_by_batch_size": 64}
    plain = make_core(model=model, max_model_len=128)
    core = make_core(model=model, max_model_len=128, speculative_config=spec)
    prompts = tokenize(plain, PROMPTS[:num_prompts])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in run_to_completion(plain, prompts, params)]
    assert [o.outputs[0].token_ids for o in run_to_completion(core, prompts, params)] == expected


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

    _assert_served_losslessly(model, out, num_speculative_tokens=3, num_prompts=6)


def test_bad_arguments_exit_with_usage() -> None:
    with pytest.raises(SystemExit) as info:
        main([])  # --out is required
    assert info.value.code == 2


def test_retune_rewrites_the_vocabulary_and_bars_of_an_existing_head(tmp_path: Path) -> None:
    """``--retune``: no training; the head's weights stay, its draft vocabulary and confidence bars are
    rewritten (here: from none to 300 ids), and it still serves losslessly."""
    model = str(tiny_model_path("llama"))
    out, cache = tmp_path / "head", tmp_path / "corpus.pt"
    argv = ["--model", model, "--out", str(out), "--num-prompts", "8", "--max-new-tokens", "10", "--max-model-len",
            "128", "--gen-batch", "8", "--no-progress", "--corpus-cache", str(cache), "--sampled-copies", "0"]
    assert main([*argv, "--epochs", "1", "--draft-vocab-size", "0"]) == 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        before = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert "draft_vocab_ids" not in before
    assert main([*argv, "--retune", "--draft-vocab-size", "300", "--min-draft-confidence", "0.4",
                 "--min-first-draft-confidence", "0.02"]) == 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        after = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert after.pop("draft_vocab_ids").numel() == 300
    assert after.keys() == before.keys() and all(after[n].equal(before[n]) for n in before)
    config = json.loads((out / "config.json").read_text())["eagle_config"]
    assert config["draft_vocab_size"] == 300
    assert (config["min_draft_confidence"], config["min_first_draft_confidence"]) == (0.4, 0.02)
    report = json.loads((out / "retune_report.json").read_text())
    assert report["retuned"] is True and report["final_train"] == {}
    assert json.loads((out / "train_report.json").read_text())["retuned"] is False  # the training's own report

    _assert_served_losslessly(model, out, num_speculative_tokens=2, num_prompts=4)


def test_retune_without_a_head_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(tiny_model_path("llama"))
    argv = ["--model", model, "--out", str(tmp_path / "none"), "--num-prompts", "2", "--max-new-tokens", "4",
            "--max-model-len", "128", "--no-progress", "--sampled-copies", "0", "--retune"]
    assert main(argv) == 1
    assert "--retune needs a trained head" in capsys.readouterr().err


def test_transformers_generator_gives_the_engines_corpus() -> None:
    """``--generator transformers`` (what ``--device cuda`` uses): the same greedy answers and the same
    final-norm features as the engine path, here both in fp32 on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nxdserve.speculative.corpus import generate_corpus
    from nxdserve.speculative.hf_corpus import generate_corpus_hf

    model = str(tiny_model_path("llama"))
    core = make_core(model=model, max_model_len=128)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = PROMPTS[:5]
    ours = {s.prompt_index: s for s in generate_corpus(core, prompts, 10)}
    eos = sorted(core.eos_token_ids)
    theirs = generate_corpus_hf(hf, tokenizer, prompts, 10, 128, eos, batch_size=2)
    assert len(theirs) == len(ours) == len(prompts)
    for seq in theirs:
        mine = ours[seq.prompt_index]
        assert seq.prompt_len == mine.prompt_len and not seq.sampled
        assert seq.tokens.tolist() == mine.tokens.tolist()
        assert seq.features.shape == (seq.tokens.size - 1, hf.config.hidden_size)
        assert (seq.features.float() - mine.features.float()).abs().max().item() < 1e-3


def test_self_written_prompts_keep_finished_distinct_questions() -> None:
    """The target's own user turns: kept only when it ended the turn (eos) within 64 tokens, with a sane
    length and not seen before; later rounds top the count up."""
    from transformers import AutoTokenizer

    from nxdserve.speculative.corpus import self_written_prompts

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path("llama")))
    eos = tokenizer.eos_token_id
    questions = ["How do volcanoes form?", "What is a prime number?", "Why is the sky blue?"]
    rounds: list[list[list[int]]] = [
        [[*tokenizer.encode(questions[0], add_special_tokens=False), eos],
         [*tokenizer.encode(questions[0], add_special_tokens=False), eos],  # a duplicate
         [*tokenizer.encode("Hi", add_special_tokens=False), eos],  # too short
         tokenizer.encode(questions[1], add_special_tokens=False)],  # never ended its turn
        [[*tokenizer.encode(q, add_special_tokens=False), eos] for q in questions[1:]],
    ]
    asked: list[tuple[int, float]] = []

    def generate(prompts: list[list[int]], max_new: int, temperature: float, seed: int) -> list[list[int]]:
        asked.append((len(prompts), temperature))
        return rounds[len(asked) - 1][: len(prompts)]

    got = self_written_prompts(tokenizer, generate, 3, frozenset({eos}), seed=0)
    assert got == questions
    assert asked == [(3, 1.0), (2, 1.0)]


def test_train_eagle_with_the_transformers_generator(tmp_path: Path) -> None:
    model = str(tiny_model_path("llama"))
    out = tmp_path / "head"
    argv = ["--model", model, "--out", str(out), "--num-prompts", "8", "--max-new-tokens", "8", "--epochs", "1",
            "--max-model-len", "128", "--gen-batch", "4", "--draft-vocab-size", "400", "--no-progress",
            "--generator", "transformers", "--sampled-copies", "1"]
    assert main(argv) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["answers"] == {"train": 14, "heldout": 1}
    _assert_served_losslessly(model, out, num_speculative_tokens=2, num_prompts=4)
