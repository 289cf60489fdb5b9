"""Speculative decoding end to end on the default model (fp32, torch backend): every method is
lossless, bounded by max_model_len in both scheduling modes, and reports its metrics."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdserve.engine.core import EngineCore
from nxdserve.engine.speculative.eagle_head import EagleHead, head_config_from_target, save_eagle_head
from nxdserve.model_files import resolve_model
from nxdserve.sampling_params import SamplingParams
from tests.helpers.engine import PROMPTS, make_core, run_to_completion, tokenize
from tests.helpers.tiny_model import tiny_model_path

K = 3
MAX_LEN = 64
MODES = {"chunked": {"enable_chunked_prefill": True, "max_num_batched_tokens": 32},  # drafts compete for budget
         "prefill-first": {"enable_chunked_prefill": False}}
ALWAYS = {"disable_by_batch_size": 1024}  # draft at every batch size: tests must not depend on timings


def _eagle_head(kind: str) -> str:
    """EAGLE heads for the default model. "identity": fc passes the target feature through and the
    layer adds nothing, so it drafts the target's own last prediction again (accepted on repetitive
    text); "random": random weights and a truncated 2000-token draft vocabulary (almost never
    accepted). Neither is trained; they exercise the proposer's bookkeeping, not its quality."""
    folder = Path(tempfile.mkdtemp(prefix=f"nxdserve-eagle-{kind}-"))
    target_config = json.loads((resolve_model(None) / "config.json").read_text())
    head = EagleHead(head_config_from_target(target_config), torch.float32, torch.device("cpu"), 256)
    g = torch.Generator().manual_seed(0)
    size = head.spec.hidden_size
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.05 * torch.randn(p.shape, generator=g))
        if kind == "identity":
            head.fc_weight.zero_()
            head.fc_weight[:, size:] = torch.eye(size)
            assert head.fc_bias is not None
            head.fc_bias.zero_()
            head.layer.o_weight.zero_()
            head.layer.down_weight.zero_()
        else:
            head.draft_vocab_ids = torch.randperm(49152, generator=g)[:2000]
    save_eagle_head(head, folder)
    return str(folder)


METHODS: dict[str, Any] = {
    "ngram": lambda: {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4},
    "self-draft": lambda: {"method": "draft_model", "self_draft_layers": 4},
    "draft-model": lambda: {"method": "draft_model", "model": str(tiny_model_path("llama"))},
    "eagle": lambda: {"method": "eagle", "model": _eagle_head("identity")},
    "eagle-random": lambda: {"method": "eagle", "model": _eagle_head("random")},
}
_cores: dict[tuple[str, str], EngineCore] = {}


def core_for(method: str | None, mode: str) -> EngineCore:
    """One core per (method, mode) for the module; None is plain decoding."""
    key = (method or "plain", mode)
    if key not in _cores:
        spec = None if method is None else {**METHODS[method](), "num_speculative_tokens": K, **ALWAYS}
        _cores[key] = make_core(max_model_len=MAX_LEN, speculative_config=spec, **MODES[mode])
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
    reg = core.metrics.registry
    drafted = reg.get_sample_value("vllm:spec_decode_num_draft_tokens_total", {"model_name": "SmolLM2-135M-Instruct"})
    accepted = reg.get_sample_value("vllm:spec_decode_num_accepted_tokens_total",
                                    {"model_name": "SmolLM2-135M-Instruct"})
    return int(drafted or 0), int(accepted or 0)


def repetitive_prompt(core: EngineCore, length: int, offset: int = 0) -> list[int]:
    """Text the model continues by repeating it: n-gram and the identity EAGLE head get accepted."""
    base = tokenize(core, ["one two three four five six seven eight nine ten " * 12])[0]
    return base[offset : offset + length]


# -- lossless ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle-random", "self-draft", "draft-model"])
def test_greedy_output_is_identical_with_speculation(method: str) -> None:
    """Batch 16 (mixed prompt lengths, some repetitive) and batch 1, in both modes, fp32."""
    for mode in MODES:
        plain, spec = core_for(None, mode), core_for(method, mode)
        prompts = tokenize(plain, PROMPTS[:12]) + [repetitive_prompt(plain, n, n % 5) for n in (5, 13, 21, 30)]
        expected = token_ids(run_to_completion(plain, prompts, greedy()))
        assert token_ids(run_to_completion(spec, prompts, greedy())) == expected, mode
        for i in (0, 13):
            assert token_ids(run_to_completion(spec, [prompts[i]], greedy())) == [expected[i]], (mode, i)
    drafted, accepted = spec_counts(spec)
    assert drafted > 0
    if method in ("ngram", "eagle"):
        assert accepted > 0  # the repetitive prompts get drafts accepted


# -- bounded by max_model_len -----------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("method", ["ngram", "eagle", "self-draft", "draft-model"])
def test_runs_to_exactly_max_model_len_from_every_late_prompt_length(method: str, mode: str) -> None:
    """Every prompt length in the last 2k + 2 positions: each request ends at exactly max_model_len
    with "length", output equal to plain decoding, no early stop at max_len - k and no crash."""
    plain, spec = core_for(None, mode), core_for(method, mode)
    lengths = range(MAX_LEN - 2 * K - 2, MAX_LEN)
    prompts = [repetitive_prompt(plain, n, n % 7) for n in lengths]
    expected = token_ids(run_to_completion(plain, prompts, greedy(None)))
    before = spec_counts(spec)
    outputs = run_to_completion(spec, prompts, greedy(None))
    assert token_ids(outputs) == expected
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].finish_reason == "length"
        assert len(prompt) + len(out.outputs[0].token_ids) == MAX_LEN
    # One at a time too: a lone request near the limit drafts with nothing else in the step.
    for prompt, want in list(zip(prompts, expected, strict=True))[:: 3]:
        assert token_ids(run_to_completion(spec, [prompt], greedy(None))) == [want]
    if method in ("ngram", "eagle"):
        assert spec_counts(spec)[1] > before[1], "no draft was accepted: the boundary was not exercised"


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_max_tokens_and_stop_tokens_trim_accepted_drafts(method: str) -> None:
    plain, spec = core_for(None, "chunked"), core_for(method, "chunked")
    prompt = repetitive_prompt(plain, 30)
    for n in range(1, 9):
        got = token_ids(run_to_completion(spec, [prompt], greedy(n)))[0]
        assert got == token_ids(run_to_completion(plain, [prompt], greedy(n)))[0] and len(got) == n
    full = token_ids(run_to_completion(plain, [prompt], greedy(12)))[0]
    stop = full[5]
    out = run_to_completion(spec, [prompt], greedy(12, stop_token_ids=[stop]))[0].outputs[0]
    assert list(out.token_ids) == full[: full.index(stop) + 1] and out.finish_reason == "stop"


def test_penalised_and_prefilling_requests_get_no_drafts() -> None:
    spec = core_for("ngram", "chunked")
    prompt = repetitive_prompt(spec, 30)
    request = spec.make_request(prompt, greedy(8, repetition_penalty=1.2))
    spec.add_request(request)
    long_prompt = repetitive_prompt(spec, 60)  # 60 tokens > the 32-token budget: prefilled in chunks
    other = spec.make_request(long_prompt, greedy(4))
    spec.add_request(other)
    while spec.has_unfinished:
        spec.step()
        assert request.spec_token_ids == []
        if other.num_computed_tokens < other.num_prompt_tokens:
            assert other.spec_token_ids == []


def test_mixed_greedy_and_sampled_rows_in_one_step() -> None:
    """Greedy rows stay exact while seeded random rows share the verification forward."""
    plain, spec = core_for(None, "chunked"), core_for("ngram", "chunked")
    prompts = [repetitive_prompt(plain, n) for n in (20, 25, 30, 35)]
    params = [greedy(12), SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)] * 2
    got = run_to_completion(spec, prompts, params)
    want = run_to_completion(plain, prompts[::2], greedy(12))
    assert token_ids(got)[::2] == token_ids(want)
    assert all(len(o.outputs[0].token_ids) == 12 for o in got)


def test_acceptance_is_logged_and_counted_per_position() -> None:
    spec = core_for("ngram", "prefill-first")
    run_to_completion(spec, [repetitive_prompt(spec, 30)], greedy(20))
    assert spec.proposer is not None
    line = spec.proposer.stats.log_line(reset=False)  # type: ignore[attr-defined]
    assert line is not None and "Mean acceptance length" in line
    assert spec.metrics is not None
    reg = spec.metrics.registry
    labels = {"model_name": "SmolLM2-135M-Instruct", "position": "0"}
    assert (reg.get_sample_value("vllm:spec_decode_num_accepted_tokens_per_pos_total", labels) or 0) > 0
    assert (reg.get_sample_value("vllm:spec_decode_num_drafts_total", {"model_name": "SmolLM2-135M-Instruct"})
            or 0) > 0
