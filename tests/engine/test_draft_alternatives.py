"""Draft alternatives end to end: a rejected first draft whose target token is one of the row's
alternatives still yields two tokens, greedy output stays the target's, sampling keeps its distribution,
and the scheduler and config handle them. A deterministic test proposer forces the alternative path."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from nxdserve.engine.core import EngineCore
from nxdserve.engine.models import fused_decode
from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.speculative.base import DraftRows, SpeculativeProposer
from nxdserve.engine.speculative.config import DEFAULT_EAGLE_ALTERNATIVES, SpeculativeConfig
from nxdserve.errors import ConfigError
from nxdserve.sampling_params import SamplingParams
from tests.engine.test_scheduler_steps import Harness
from tests.engine.test_speculative import copycat_model
from tests.engine.test_speculative_sampling import (
    NUM_SAMPLES,
    chi_square_critical,
    exact_distribution,
    sample_counts,
)
from tests.helpers.engine import make_core, run_to_completion
from tests.helpers.tiny_model import tiny_model_path

MAX_TOKENS = 16


class KnownAnswerProposer(SpeculativeProposer):
    """Drafts a wrong first token and offers the right one (from a reference run) as an alternative, so
    every drafting step takes the alternative path."""

    method = "known-answer"

    def __init__(self, k: int, max_model_len: int, vocab: int, reference: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__(SpeculativeConfig(method="ngram", num_speculative_tokens=k, disable_by_batch_size=1024),
                         max_model_len)
        self.vocab = vocab
        self.reference = reference

    def draft(self, rows: DraftRows, batch: PersistentBatch) -> tuple[np.ndarray, np.ndarray]:
        drafts = np.zeros((rows.num_rows, int(rows.k.max())), dtype=np.int64)
        alternatives = np.zeros((rows.num_rows, 2), dtype=np.int64)
        for i, request in enumerate(rows.requests):
            right = self.reference[tuple(request.prompt_token_ids)][request.num_output_tokens]
            drafts[i] = (right + 1) % self.vocab
            alternatives[i] = [(right + 2) % self.vocab, right]
        self.alternatives = alternatives
        return drafts, rows.k.copy()


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, 250, size=n).tolist() for n in (5, 9, 14, 20)]


# The forward each configuration verifies alternatives in: the layer path (fp32 dense), the fused quantized forward
# (csrc/qdecode.c: an fp32 model on int8 codes, fp32 or fp8 KV) and, on AVX512-BF16 builds, the fused bf16 forward
# (csrc/decode.c) on an fp8 cache.
FORWARDS = {
    "layers": ({}, None),
    "quantized-fused": ({"quantization": "int8"}, "fused_quant_decode"),
    "quantized-fused-fp8": ({"quantization": "int8", "kv_cache_dtype": "fp8"}, "fused_quant_decode"),
    "bf16-fused-fp8": ({"dtype": "bfloat16", "kv_cache_dtype": "fp8"}, "fused_decode"),
}


@pytest.mark.parametrize("forward", list(FORWARDS))
@pytest.mark.parametrize("k", [1, 2])
def test_alternative_hits_keep_greedy_output_and_yield_two_tokens(
    k: int, forward: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, fused_name = FORWARDS[forward]
    model = str(tiny_model_path("llama"))
    prompts = _prompts()
    plain = make_core(model=model, max_model_len=64, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = [list(o.outputs[0].token_ids) for o in run_to_completion(plain, prompts, params)]

    core = make_core(model=model, max_model_len=64, **settings)
    assert core.backend.capabilities.draft_alternatives
    steps_with_alternatives: list[bool] = []
    if fused_name is not None:
        fused = getattr(core.backend.runner.model, fused_name)  # type: ignore[attr-defined]
        if fused_name == "fused_decode" and not fused_decode.available():
            pytest.skip("no fused bf16 forward on this machine")
        original = fused.run

        def run(x: Any, meta: Any, *args: Any, **kwargs: Any) -> Any:
            steps_with_alternatives.append(meta.alts is not None)
            return original(x, meta, *args, **kwargs)

        monkeypatch.setattr(fused, "run", run)
    proposer = KnownAnswerProposer(k, 64, core.backend.capabilities.vocab_size,
                                   {tuple(p): r for p, r in zip(prompts, reference, strict=True)})
    core.proposer = proposer
    # One request also asks for logprobs: the backend must not take the alternative path for it (its extra
    # token would carry none), yet its output stays the target's.
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outputs = run_to_completion(core, prompts, [params, params, params, with_logprobs])
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference
    assert outputs[3].outputs[0].logprobs is not None and len(outputs[3].outputs[0].logprobs) == MAX_TOKENS
    total = proposer.stats.total
    # Three requests take two tokens per drafting step (a wrong first draft, the right alternative, then the
    # target's token after it); the logprobs request gets one.
    assert total.num_accepted > 0
    assert total.num_accepted == total.num_drafts - _drafting_steps_of_one_request(MAX_TOKENS)
    # Every alternative path taken is counted: two alternatives per eligible row, one of them accepted.
    assert total.num_alternative_hits == total.num_accepted and total.num_alternatives == 2 * total.num_accepted
    assert core.metrics is not None
    registry, labels = core.metrics.registry, {"model_name": model}
    assert registry.get_sample_value("nxdserve:spec_decode_num_alternative_hits_total", labels) == total.num_accepted
    assert registry.get_sample_value("nxdserve:spec_decode_num_alternative_tokens_total", labels) == \
        2 * total.num_accepted
    line = proposer.stats.log_line()
    assert line is not None and f"Alternatives: {total.num_accepted} of {2 * total.num_accepted} accepted" in line
    if fused_name is not None:  # the verification steps with alternatives ran in the fused forward
        assert sum(steps_with_alternatives) > 0


def _drafting_steps_of_one_request(max_tokens: int) -> int:
    """A request whose drafts are always rejected drafts once per output token after the first, except the
    last (no drafts when one token remains)."""
    return max_tokens - 2


def test_alternatives_keep_the_sampled_distribution() -> None:
    """Sampled rows: the first draft is accepted with the target's probability of it; on rejection the
    target's own token comes from the residual, and if it is an alternative the row continues from it."""
    model = copycat_model()
    expected = exact_distribution(model)
    candidates = sorted({t for path in expected for t in path})
    assert len(candidates) >= 2
    core: EngineCore = make_core(model=model, max_model_len=64, max_num_seqs=64, max_num_batched_tokens=512)

    class CandidateProposer(SpeculativeProposer):
        method = "candidates"

        def draft(self, rows: DraftRows, batch: PersistentBatch) -> tuple[np.ndarray, np.ndarray]:
            n = rows.num_rows
            drafts = np.tile(np.array(candidates[:1] * int(rows.k.max()), dtype=np.int64), (n, 1))
            self.alternatives = np.tile(np.array(candidates[1:], dtype=np.int64), (n, 1))
            return drafts, rows.k.copy()

    proposer = CandidateProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=1,
                                                   disable_by_batch_size=1024), 64)
    core.proposer = proposer
    first_draft_wins, alternative_wins = [0], [0]
    execute = core.backend.execute

    def counting_execute(plan: Any) -> Any:
        result = execute(plan)
        two = (result.num_sampled == 2) & (plan.num_drafts == 1)
        first = result.sampled_token_ids[:, 0] == candidates[0]
        first_draft_wins[0] += int((two & first).sum())
        alternative_wins[0] += int((two & ~first).sum())
        return result

    core.backend.execute = counting_execute  # type: ignore[method-assign]
    counts = sample_counts(core)
    assert set(counts) <= set(expected)
    stat = sum((counts.get(path, 0) - NUM_SAMPLES * p) ** 2 / (NUM_SAMPLES * p) for path, p in expected.items())
    tv = 0.5 * sum(abs(counts.get(path, 0) / NUM_SAMPLES - p) for path, p in expected.items())
    assert stat < chi_square_critical(len(expected) - 1), (stat, tv)
    assert tv < 0.05, tv
    # The draft and its alternatives cover the target's whole top-k, so every drafting row yields two tokens,
    # through the first draft or through an alternative, and both happen often.
    total = proposer.stats.total
    assert total.num_drafts > 0 and total.num_accepted == total.num_drafts
    assert min(first_draft_wins[0], alternative_wins[0]) > NUM_SAMPLES // 10, (first_draft_wins, alternative_wins)


def test_scheduler_sends_alternatives_only_with_drafts_and_within_the_budget() -> None:
    h = Harness(chunked=True, budget=10, max_num_seqs=3)
    for rid in "ABC":
        h.add(rid, 2, max_tokens=10)
    h.step()  # the three prompts (6 tokens)
    a, b, c = (h.requests[r] for r in "ABC")
    a.spec_token_ids, a.spec_alt_ids = [7, 8], [9]
    b.spec_token_ids, b.spec_alt_ids = [], [5]  # no drafts: its alternatives are dropped
    c.spec_token_ids, c.spec_alt_ids = [4], [6, 2]
    out = h.scheduler.schedule()
    assert out.plan.draft_alternatives is not None
    assert out.plan.draft_alternatives.tolist() == [[9, -1], [-1, -1], [6, 2]]  # 6 row tokens + 3 <= 10
    assert a.spec_alt_ids == b.spec_alt_ids == c.spec_alt_ids == []  # one step's worth, never carried over
    h.scheduler.update_from_output(out, h.backend.execute(out.plan))
    # 2 + 2 + 2 row tokens leave room for 4 of the 5 alternatives: none go.
    for r in (a, b, c):
        r.spec_token_ids, r.spec_alt_ids = [4], [5, 6] if r is not b else [7]
    out = h.scheduler.schedule()
    assert int(out.plan.num_scheduled.sum()) == 6 and out.plan.draft_alternatives is None


def test_config_takes_draft_alternatives_for_eagle_only(tmp_path: Any) -> None:
    from tests.helpers.eagle import eagle_head

    head = eagle_head(str(tiny_model_path("llama")), "identity")
    assert SpeculativeConfig.from_dict({"method": "eagle", "model": head, "num_speculative_tokens": 1}) \
        .draft_alternatives == DEFAULT_EAGLE_ALTERNATIVES
    assert SpeculativeConfig.from_dict({"method": "eagle", "model": head, "num_speculative_tokens": 1,
                                        "draft_alternatives": 0}).draft_alternatives == 0
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3}).draft_alternatives == 0
    with pytest.raises(ConfigError, match="draft_alternatives only applies to method 'eagle'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "draft_alternatives": 2})
    with pytest.raises(ConfigError, match=r"draft_alternatives must be in \[0, 7\]"):
        SpeculativeConfig.from_dict({"method": "eagle", "model": head, "num_speculative_tokens": 1,
                                     "draft_alternatives": 8})
