"""Random sampling with speculation has exactly the target's distribution (rejection sampling is
lossless): thousands of seeded samples on a tiny model against probabilities computed independently
with transformers."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch

from nxdserve.engine.core import EngineCore
from nxdserve.sampling_params import OutputKind, SamplingParams
from tests.engine.test_speculative import copycat_model
from tests.helpers.engine import make_core

PROMPT = [101, 202, 303, 101, 202, 303, 101, 202]  # repeats, so the n-gram proposer always has a match
NUM_TOKENS = 4
TOP_K = 2  # 2^4 = 16 possible outputs
TEMPERATURE = 1.3  # flatter than the model, so both candidates are common and drafts are often rejected
NUM_SAMPLES = 4000


def exact_distribution(model: str) -> dict[tuple[int, ...], float]:
    """P(output) for every top-k path, from transformers' implementation of the same checkpoint."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def step(prefix: tuple[int, ...]) -> list[tuple[int, float]]:
        with torch.no_grad():
            logits = hf(torch.tensor([[*PROMPT, *prefix]])).logits[0, -1] / TEMPERATURE
        top = torch.topk(logits, TOP_K)
        probs = torch.softmax(top.values, dim=-1)
        return list(zip(top.indices.tolist(), probs.tolist(), strict=True))

    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NUM_TOKENS):
        dist = {(*path, tok): p * q for path, p in dist.items() for tok, q in step(path)}
    return dist


def sample_counts(core: EngineCore) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    ids: list[str] = []
    for seed in range(NUM_SAMPLES):
        params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=NUM_TOKENS, seed=seed,
                                ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
        request = core.make_request(PROMPT, params)
        core.add_request(request)
        ids.append(request.request_id)
    outputs: dict[str, Any] = {}
    while core.has_unfinished:
        for out in core.step():
            if out.finished:
                outputs[out.request_id] = out
    for request_id in ids:
        path = tuple(outputs[request_id].outputs[0].token_ids)
        counts[path] = counts.get(path, 0) + 1
    return counts


def chi_square_critical(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at normal score z (3.29: p = 0.0005)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("method", ["ngram", "eagle", "draft-model"])
def test_sampled_outputs_follow_the_target_distribution(method: str) -> None:
    from tests.engine.test_speculative import method_config

    model = copycat_model()
    expected = exact_distribution(model)
    assert abs(sum(expected.values()) - 1.0) < 1e-5
    core = make_core(model=model, max_model_len=64, max_num_seqs=64, max_num_batched_tokens=256,
                     speculative_config=method_config(method, model))
    counts = sample_counts(core)
    assert set(counts) <= set(expected), "a token outside the target's top-k was emitted"
    stat = sum((counts.get(path, 0) - NUM_SAMPLES * p) ** 2 / (NUM_SAMPLES * p) for path, p in expected.items())
    tv = 0.5 * sum(abs(counts.get(path, 0) / NUM_SAMPLES - p) for path, p in expected.items())
    assert stat < chi_square_critical(len(expected) - 1), (stat, tv)
    assert tv < 0.05, tv
    # The run must have exercised verification both ways: drafts accepted and drafts rejected.
    assert core.proposer is not None
    stats = core.proposer.stats.total  # type: ignore[attr-defined]
    assert 0 < stats.num_accepted < stats.num_draft_tokens, (stats.num_accepted, stats.num_draft_tokens)


def test_the_exact_distribution_is_not_degenerate() -> None:
    """Sanity for the test above: many paths carry real probability, so a biased verifier shows."""
    dist = exact_distribution(copycat_model())
    probs = np.array(sorted(dist.values(), reverse=True))
    assert len(probs) == TOP_K**NUM_TOKENS and probs[0] < 0.5 and (probs > 0.01).sum() >= 6
    assert list(itertools.islice(dist, 1))
