"""Speculative decoding end to end (fp32, torch backend): every method is lossless, bounded by
max_model_len in both scheduling modes, and reports its metrics.

Most tests run on tiny checkpoints (milliseconds per step): a random tiny Llama for losslessness
(drafts mostly rejected), and a "copycat" tiny Llama that mostly repeats itself, so drafts are mostly
accepted and requests reach max_model_len in multi-token steps. The default model gets a smoke test
here and the full matrix in test_speculative_default.py (slow)."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.core import EngineCore
from nxdserve.engine.models import cpu_build, greedy_head
from nxdserve.engine.models.quant import QuantLinear
from nxdserve.sampling_params import SamplingParams
from tests.helpers.eagle import eagle_head
from tests.helpers.engine import PROMPTS, make_core, run_to_completion, tokenize
from tests.helpers.tiny_model import build_tiny_model, tiny_model_path

K = 3
MAX_LEN = 40
MODES = {"chunked": {"enable_chunked_prefill": True, "max_num_batched_tokens": 24},  # drafts compete for budget
         "prefill-first": {"enable_chunked_prefill": False}}
ALWAYS = {"disable_by_batch_size": 1024}  # draft at every batch size: tests must not depend on timings
PROMPT_TEXTS = PROMPTS[:12]


@cache
def copycat_model() -> str:
    """A tiny Llama whose layers are damped, so greedy decoding mostly repeats the last token: every
    proposer's drafts get accepted often (but not always), which drives requests to max_model_len
    in multi-token steps. Its draft model has the same weights, damped a little more: it agrees with
    the target most of the time."""
    return _damped_tiny(seed=2, scale=0.5)


@cache
def copycat_draft() -> str:
    return _damped_tiny(seed=2, scale=0.4)


def _damped_tiny(seed: int, scale: float) -> str:
    folder = Path(tempfile.mkdtemp(prefix="nxdserve-copycat-")) / "model"
    atexit.register(shutil.rmtree, folder.parent, True)
    build_tiny_model("llama", folder, seed=seed)
    weights = load_file(str(folder / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones_like(tensor)
        elif ".layers." in name:
            weights[name] = tensor * scale
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def method_config(method: str, target: str | None) -> dict[str, Any]:
    draft = copycat_draft() if target == copycat_model() else str(tiny_model_path("llama"))
    configs: dict[str, dict[str, Any]] = {
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4},
        "self-draft": {"method": "draft_model", "self_draft_layers": 1},
        "draft-model": {"method": "draft_model", "model": draft},
        "eagle": {"method": "eagle", "model": eagle_head(target, "identity")},
        "eagle-random": {"method": "eagle", "model": eagle_head(target, "random")},
    }
    return {**configs[method], "num_speculative_tokens": K, **ALWAYS}


_cores: dict[tuple[str, str | None, str], EngineCore] = {}


def core_for(target: str, method: str | None, mode: str) -> EngineCore:
    """One core per (target, method, mode) for the module; method None is plain decoding."""
    key = (target, method, mode)
    if key not in _cores:
        spec = None if method is None else method_config(method, target)
        _cores[key] = make_core(model=target, max_model_len=MAX_LEN, speculative_config=spec, **MODES[mode])
    return _cores[key]


@pytest.fixture(scope="module", autouse=True)
def _release_cores() -> Iterator[None]:
    yield
    _cores.clear()


def greedy(max_tokens: int | None = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def spec_counts(core: EngineCore) -> tuple[int, int]:
    """(draft tokens, accepted tokens) so far, from the Prometheus counters."""
    assert core.metrics is not None
    reg, labels = core.metrics.registry, {"model_name": core.config.model or "SmolLM2-135M-Instruct"}
    drafted = reg.get_sample_value("vllm:spec_decode_num_draft_tokens_total", labels)
    accepted = reg.get_sample_value("vllm:spec_decode_num_accepted_tokens_total", labels)
    return int(drafted or 0), int(accepted or 0)


def prompts_of_lengths(core: EngineCore, lengths: Iterable[int]) -> list[list[int]]:
    """Varied prompts: the test texts cycled and cut to each length."""
    base = [t for ids in tokenize(core, PROMPT_TEXTS) for t in ids]
    return [base[3 * n % 50 : 3 * n % 50 + n] for n in lengths]


# -- lossless ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle-random", "self-draft", "draft-model"])
def test_greedy_output_is_identical_with_speculation(method: str) -> None:
    """fp32, batch 16 and batch 1, both modes: every method gives exactly the plain greedy tokens."""
    target = str(tiny_model_path("llama"))
    for mode in MODES:
        plain, spec = core_for(target, None, mode), core_for(target, method, mode)
        prompts = tokenize(plain, PROMPT_TEXTS) + prompts_of_lengths(plain, (1, 9, 17, 23))
        expected = token_ids(run_to_completion(plain, prompts, greedy()))
        assert token_ids(run_to_completion(spec, prompts, greedy())) == expected, mode
        for i in (0, 13):
            assert token_ids(run_to_completion(spec, [prompts[i]], greedy())) == [expected[i]], (mode, i)
        assert spec_counts(spec)[0] > 0, "nothing was drafted"
        assert spec.proposer is not None and spec.proposer.failures == 0  # type: ignore[attr-defined]


# -- bounded by max_model_len -----------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("method", ["ngram", "eagle", "self-draft", "draft-model"])
def test_runs_to_exactly_max_model_len_from_every_late_prompt_length(method: str, mode: str) -> None:
    """Every prompt length in the last 2k + 2 positions: each request ends at exactly max_model_len
    with "length" and the plain tokens - no early stop at max_len - k, no crash - whether the
    lengths share steps or run alone."""
    target = copycat_model()
    plain, spec = core_for(target, None, mode), core_for(target, method, mode)
    prompts = prompts_of_lengths(plain, range(MAX_LEN - 2 * K - 2, MAX_LEN))
    expected = token_ids(run_to_completion(plain, prompts, greedy(None)))
    before = spec_counts(spec)
    outputs = run_to_completion(spec, prompts, greedy(None))
    assert token_ids(outputs) == expected
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].finish_reason == "length"
        assert len(prompt) + len(out.outputs[0].token_ids) == MAX_LEN
    for prompt, want in zip(prompts, expected, strict=True):
        out = run_to_completion(spec, [prompt], greedy(None))[0]
        assert list(out.outputs[0].token_ids) == want and out.outputs[0].finish_reason == "length"
    assert spec_counts(spec)[1] - before[1] > 0, "no draft accepted: no multi-token steps"
    assert spec.proposer is not None and spec.proposer.failures == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("method", ["ngram", "eagle", "draft-model"])
def test_max_tokens_and_stop_tokens_trim_accepted_drafts(method: str) -> None:
    target = copycat_model()
    plain, spec = core_for(target, None, "chunked"), core_for(target, method, "chunked")
    prompt = prompts_of_lengths(plain, [12])[0]
    for n in range(1, 2 * K + 2):
        got = token_ids(run_to_completion(spec, [prompt], greedy(n)))[0]
        assert got == token_ids(run_to_completion(plain, [prompt], greedy(n)))[0] and len(got) == n
    full = token_ids(run_to_completion(plain, [prompt], greedy(20)))[0]
    for stop in dict.fromkeys(full[1:]):  # each distinct token as a stop id: the first occurrence ends it
        out = run_to_completion(spec, [prompt], greedy(20, stop_token_ids=[stop]))[0].outputs[0]
        assert list(out.token_ids) == full[: full.index(stop) + 1] and out.finish_reason == "stop"


def test_penalised_and_prefilling_requests_get_no_drafts() -> None:
    target = copycat_model()
    spec = core_for(target, "ngram", "chunked")
    request = spec.make_request(prompts_of_lengths(spec, [10])[0], greedy(8, repetition_penalty=1.2))
    spec.add_request(request)
    long_prompt = prompts_of_lengths(spec, [35])[0]  # longer than the 24-token budget: prefilled in chunks
    other = spec.make_request(long_prompt, greedy(4))
    spec.add_request(other)
    drafted_while_prefilling = False
    while spec.has_unfinished:
        spec.step()
        assert request.spec_token_ids == []
        drafted_while_prefilling |= other.is_prefilling and bool(other.spec_token_ids)
    assert not drafted_while_prefilling


def test_mixed_greedy_and_sampled_rows_in_one_step() -> None:
    """Greedy rows stay exact while seeded random rows are verified in the same forward."""
    target = copycat_model()
    plain, spec = core_for(target, None, "chunked"), core_for(target, "eagle", "chunked")
    prompts = prompts_of_lengths(plain, (6, 8, 10, 12))
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    got = run_to_completion(spec, prompts, [greedy(12), sampled] * 2)
    assert token_ids(got)[::2] == token_ids(run_to_completion(plain, prompts[::2], greedy(12)))
    assert all(len(o.outputs[0].token_ids) == 12 for o in got)


def test_acceptance_is_logged_and_counted_per_position() -> None:
    spec = core_for(copycat_model(), "ngram", "prefill-first")
    run_to_completion(spec, prompts_of_lengths(spec, [10]), greedy(20))
    assert spec.proposer is not None
    line = spec.proposer.stats.log_line(reset=False)  # type: ignore[attr-defined]
    assert line is not None and "Mean acceptance length" in line and "Per-position acceptance rate" in line
    assert spec.metrics is not None
    reg, name = spec.metrics.registry, spec.config.model
    assert (reg.get_sample_value("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                 {"model_name": name, "position": "0"}) or 0) > 0
    assert (reg.get_sample_value("vllm:spec_decode_num_drafts_total", {"model_name": name}) or 0) > 0


# -- the default model ------------------------------------------------------------------------------
def test_default_model_greedy_is_identical_with_ngram_and_eagle() -> None:
    for method in ("ngram", "eagle"):
        plain = make_core(max_model_len=MAX_LEN, **MODES["chunked"])
        spec = make_core(max_model_len=MAX_LEN, speculative_config=method_config(method, None), **MODES["chunked"])
        prompts = tokenize(plain, ["1, 2, 3, 4, 5, 6,", "The cat sat on the mat. The cat sat on the"])
        assert token_ids(run_to_completion(spec, prompts, greedy(10))) == token_ids(
            run_to_completion(plain, prompts, greedy(10)))


def test_eagle_stops_drafting_where_the_head_is_unsure(tmp_path: Path) -> None:
    """``eagle_config.min_draft_confidence``: drafts stop once the product of the head's top
    probabilities falls below it (1.01: nothing is ever drafted); ``min_first_draft_confidence``, when
    given, is draft 1's own bar (0 and 1.01: one draft per round). Output stays exactly plain greedy."""
    target = copycat_model()
    plain = core_for(target, None, "chunked")
    prompts = prompts_of_lengths(plain, (6, 9, 12, 15))
    expected = token_ids(run_to_completion(plain, prompts, greedy(16)))
    drafted, rounds = {}, {}
    for first, threshold in ((None, 0.0), (None, 0.005), (None, 1.01), (0.0, 1.01)):
        folder = tmp_path / f"head-{first}-{threshold}"
        shutil.copytree(eagle_head(target, "identity"), folder)
        config = json.loads((folder / "config.json").read_text())
        config["eagle_config"]["min_draft_confidence"] = threshold
        if first is not None:
            config["eagle_config"]["min_first_draft_confidence"] = first
        (folder / "config.json").write_text(json.dumps(config))
        spec = {**method_config("eagle", target), "model": str(folder)}
        core = make_core(model=target, max_model_len=MAX_LEN, speculative_config=spec, **MODES["chunked"])
        assert token_ids(run_to_completion(core, prompts, greedy(16))) == expected, (first, threshold)
        assert core.proposer is not None and core.proposer.failures == 0  # type: ignore[attr-defined]
        drafted[first, threshold] = spec_counts(core)[0]
        assert core.metrics is not None
        rounds[first, threshold] = core.metrics.registry.get_sample_value(
            "vllm:spec_decode_num_drafts_total", {"model_name": core.config.model}) or 0
    assert drafted[None, 1.01] == 0 < drafted[None, 0.0]
    # This untrained head is rarely sure: a low threshold keeps some chains and cuts others short.
    assert 0 < drafted[None, 0.005] < drafted[None, 0.0]
    assert 0 < drafted[0.0, 1.01] == rounds[0.0, 1.01]


def test_eagle_skips_its_cache_update_at_large_batch_while_drafting_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above SYNC_WHILE_OFF_MAX_BATCH decoding requests, steps that will not draft skip the head's cache
    update; those requests never draft again (their cache has a hole) and stay exactly plain greedy,
    and a request admitted later into a reused slot drafts normally."""
    import nxdserve.engine.speculative.eagle as eagle_module

    monkeypatch.setattr(eagle_module, "SYNC_WHILE_OFF_MAX_BATCH", 1)
    target = copycat_model()
    plain = core_for(target, None, "chunked")
    prompts = prompts_of_lengths(plain, (6, 9, 12))
    expected = token_ids(run_to_completion(plain, prompts, greedy(16)))
    spec = {**method_config("eagle", target), "disable_by_batch_size": 1}  # draft only while 1 request decodes
    core = make_core(model=target, max_model_len=MAX_LEN, speculative_config=spec, **MODES["chunked"])
    assert token_ids(run_to_completion(core, prompts, greedy(16))) == expected
    proposer = core.proposer
    assert proposer is not None and proposer.failures == 0  # type: ignore[attr-defined]
    assert proposer.stale.any()  # type: ignore[attr-defined]
    assert spec_counts(core)[0] == 0  # the last request to finish had a hole: it never drafted
    assert token_ids(run_to_completion(core, prompts[:1], greedy(16))) == expected[:1]
    assert spec_counts(core)[0] > 0  # alone in a reused slot: drafts again


@pytest.mark.skipif(not greedy_head.available(), reason="no AVX512-VNNI/BF16 C kernels here")
def test_bf16_verification_from_the_lm_head_screen_is_lossless(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16, where greedy rows take their argmax from the LM-head screen (``greedy_head``), verification
    rows included: n-gram speculation gives exactly the plain tokens, and the screen answered every step."""
    settings = {"max_model_len": 96, "dtype": "bfloat16", **MODES["chunked"]}
    plain = make_core(**settings)
    spec = make_core(**settings, speculative_config=method_config("ngram", None))
    screen = spec.backend.runner.model.greedy_head  # type: ignore[attr-defined]
    answered = []
    original = screen.argmax

    def counted(hidden: torch.Tensor, vocab: int) -> torch.Tensor | None:
        got = original(hidden, vocab)
        answered.append(got is not None)
        return got

    monkeypatch.setattr(screen, "argmax", counted)
    texts = ["1, 2, 3, 4, 5, 6,", "The cat sat on the mat. The cat sat on the", *PROMPT_TEXTS[:6]]
    prompts = tokenize(plain, texts)
    assert token_ids(run_to_completion(spec, prompts, greedy(40))) == token_ids(
        run_to_completion(plain, prompts, greedy(40)))
    drafted, accepted = spec_counts(spec)
    assert drafted > 0 and accepted > 0
    assert answered and all(answered)


# int4: what a .gguf model is served as by default; bf16: a dense model's weights under --dtype auto on a CPU
# without native bf16 (a forced AVX2 build stands for one).
QUANTIZED_TARGETS = {"int4": {"quantization": "int4"}, "bf16": {"dtype": "auto", "cpu": CpuOptions(isa="avx2")}}


@pytest.mark.parametrize("target_format", list(QUANTIZED_TARGETS))
@pytest.mark.parametrize("method", ["draft-model", "self-draft"])
def test_quantized_target_with_a_dense_draft_is_lossless(method: str, target_format: str) -> None:
    """A quantized target verifies a dense draft model's drafts (or its own first layer's, sharing the quantized
    layers): greedy output is exactly the plain quantized target's."""
    if target_format == "bf16" and "avx2" not in cpu_build.runnable_paths():
        pytest.skip("needs the avx2 kernel build")
    target = copycat_model()
    settings = {"model": target, "max_model_len": MAX_LEN, **QUANTIZED_TARGETS[target_format], **MODES["chunked"]}
    plain = make_core(**settings)
    prompts = prompts_of_lengths(plain, (6, 9, 12))
    expected = token_ids(run_to_completion(plain, prompts, greedy(16)))
    core = make_core(**settings, speculative_config=method_config(method, target))
    target_qkv = core.backend.model.layers[0].qkv_weight  # type: ignore[attr-defined]
    assert isinstance(target_qkv, QuantLinear) and target_qkv.kind == target_format
    assert token_ids(run_to_completion(core, prompts, greedy(16))) == expected
    drafted, accepted = spec_counts(core)
    assert drafted > 0 and accepted > 0
    if method == "draft-model":  # the draft stays dense
        draft_layer = core.proposer.runner.model.layers[0]  # type: ignore[attr-defined]
        assert isinstance(draft_layer.qkv_weight, torch.Tensor)
