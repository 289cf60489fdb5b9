"""nxdserve bench: token-exact synthetic datasets and arrival schedules.

Uses a small byte-level BPE trained in-process (no model files): its vocabulary is half raw bytes, which
makes exact-length prompts harder to build than with a real tokenizer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from nxdserve.bench.arrivals import arrival_times
from nxdserve.bench.datasets import (
    SampleRequest,
    _synthetic_text,
    allowed_token_ids,
    is_valid_sharegpt_pair,
    prefix_repetition_dataset,
    random_dataset,
    sharegpt_like_dataset,
)
from nxdserve.bench.tokenizer import HFTokenizer


def _train(add_bos: bool) -> HFTokenizer:
    corpus = [_synthetic_text(np.random.default_rng(i), 60) for i in range(150)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<|endoftext|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<s>")
    return HFTokenizer(hf, "tiny-bpe" + ("-bos" if add_bos else ""))


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return _train(add_bos=False)


@pytest.fixture(scope="module")
def tok_bos() -> HFTokenizer:
    return _train(add_bos=True)


def _assert_exact(tok: HFTokenizer, reqs: list[SampleRequest]) -> None:
    for r in reqs:
        assert len(tok.encode(r.prompt)) == r.prompt_len, r.request_id


def test_random_exact_lengths_and_no_special_tokens(tok: HFTokenizer) -> None:
    reqs = random_dataset(tok, 20, input_len=120, output_len=9, seed=3)
    assert [r.prompt_len for r in reqs] == [120] * 20
    assert [r.expected_output_len for r in reqs] == [9] * 20
    _assert_exact(tok, reqs)
    for r in reqs:
        assert not set(tok.encode(r.prompt)) & tok.special_ids
    # Offsets and the index make prompts differ (a few may coincide here: this tiny vocabulary is half raw
    # bytes, and runs of invalid UTF-8 all decode to U+FFFD).
    assert len({r.prompt for r in reqs}) > 10


def test_random_range_ratio_bounds(tok: HFTokenizer) -> None:
    reqs = random_dataset(tok, 200, input_len=100, output_len=20, range_ratio=0.5, seed=1)
    ins = [r.prompt_len for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 20
    assert min(outs) >= 10 and max(outs) <= 30 and len(set(outs)) > 5
    _assert_exact(tok, reqs)
    with pytest.raises(ValueError):
        random_dataset(tok, 1, range_ratio=1.0)


def test_random_counts_special_tokens_the_server_adds(tok_bos: HFTokenizer) -> None:
    assert tok_bos.num_special_tokens_to_add() == 1
    reqs = random_dataset(tok_bos, 5, input_len=64, output_len=4)
    # The server prepends BOS, so the text itself is one token shorter and the server sees 64.
    assert all(r.prompt_len == 63 for r in reqs)
    assert all(len(tok_bos.encode(r.prompt, add_special_tokens=True)) == 64 for r in reqs)


def test_random_prefix_is_shared(tok: HFTokenizer) -> None:
    reqs = random_dataset(tok, 6, input_len=40, output_len=4, prefix_len=30, seed=2)
    assert all(r.prompt_len == 70 for r in reqs)
    heads = {tuple(tok.encode(r.prompt)[:29]) for r in reqs}
    assert len(heads) == 1


def test_random_deterministic_by_seed(tok: HFTokenizer) -> None:
    a = random_dataset(tok, 8, input_len=50, output_len=8, range_ratio=0.3, seed=7)
    b = random_dataset(tok, 8, input_len=50, output_len=8, range_ratio=0.3, seed=7)
    c = random_dataset(tok, 8, input_len=50, output_len=8, range_ratio=0.3, seed=8)
    assert [(r.prompt, r.expected_output_len) for r in a] == [(r.prompt, r.expected_output_len) for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_sharegpt_like_lengths_follow_pruning_rules(tok: HFTokenizer) -> None:
    reqs = sharegpt_like_dataset(tok, 300, seed=0)
    assert len(reqs) == 300
    _assert_exact(tok, reqs)
    for r in reqs:
        assert is_valid_sharegpt_pair(r.prompt_len, r.expected_output_len)
    ins = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.expected_output_len for r in reqs])
    # A wide, long-tailed mix: most prompts short, some long; outputs longer on average.
    assert 60 < np.median(ins) < 200 and ins.max() > 400 and ins.min() < 30
    assert outs.mean() > ins.mean()
    assert reqs[0].prompt[0].isupper()  # English-like filler, not token soup

    small = sharegpt_like_dataset(tok, 50, seed=1, output_len=16, max_prompt_len=200, max_total_len=216)
    assert all(r.expected_output_len == 16 and 4 <= r.prompt_len <= 200 for r in small)
    again = sharegpt_like_dataset(tok, 50, seed=1, output_len=16, max_prompt_len=200, max_total_len=216)
    assert [r.prompt for r in small] == [r.prompt for r in again]


def test_is_valid_sharegpt_pair() -> None:
    assert is_valid_sharegpt_pair(4, 4)
    assert not is_valid_sharegpt_pair(3, 100)
    assert not is_valid_sharegpt_pair(100, 3)
    assert not is_valid_sharegpt_pair(1025, 10)
    assert is_valid_sharegpt_pair(1024, 1024)
    assert not is_valid_sharegpt_pair(1024, 1025)


def test_prefix_repetition_groups_share_exact_prefixes(tok: HFTokenizer) -> None:
    reqs = prefix_repetition_dataset(tok, 13, prefix_len=40, suffix_len=25, num_prefixes=4, output_len=6, seed=5)
    assert len(reqs) == 13
    assert all(r.prompt_len == 65 and r.expected_output_len == 6 for r in reqs)
    _assert_exact(tok, reqs)
    groups: dict[str, set[tuple[int, ...]]] = {}
    for r in reqs:
        groups.setdefault(r.group, set()).add(tuple(tok.encode(r.prompt)[:40]))
    assert len(groups) == 4 and sorted(len(g) for g in groups.values()) == [1, 1, 1, 1]
    assert len({next(iter(g)) for g in groups.values()}) == 4  # different groups, different prefixes
    assert len({r.prompt for r in reqs}) == 13  # suffixes differ
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # shuffled
    again = prefix_repetition_dataset(tok, 13, prefix_len=40, suffix_len=25, num_prefixes=4, output_len=6, seed=5)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    with pytest.raises(ValueError):
        prefix_repetition_dataset(tok, 3, num_prefixes=4)


def test_allowed_ids_exclude_specials(tok: HFTokenizer) -> None:
    allowed = allowed_token_ids(tok)
    assert len(allowed) == tok.vocab_size - len(tok.special_ids)
    assert not set(allowed.tolist()) & tok.special_ids


# -- arrivals ------------------------------------------------------------------------------------------


def test_poisson_arrivals_mean_rate_and_dispersion() -> None:
    times = np.array(arrival_times(4000, request_rate=20.0, burstiness=1.0, seed=0))
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert np.all(gaps >= 0)
    assert times[-1] == pytest.approx(4000 / 20.0)  # scaled so the run lasts exactly n / rate
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.08)  # exponential gaps: CV 1
    # Over windows of 10 s the count of arrivals is about rate * 10 (Poisson, sd ~ 14).
    counts = np.histogram(times, bins=np.arange(0, 201, 10))[0]
    assert abs(counts.mean() - 200) < 1 and counts.std() < 40


def test_gamma_burstiness_and_seeds() -> None:
    regular = np.diff(arrival_times(4000, 10.0, burstiness=4.0, seed=1))
    bursty = np.diff(arrival_times(4000, 10.0, burstiness=0.25, seed=1))
    assert regular.std() / regular.mean() == pytest.approx(0.5, abs=0.06)  # CV = 1/sqrt(shape)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, abs=0.3)
    assert arrival_times(50, 5.0, seed=3) == arrival_times(50, 5.0, seed=3)
    assert arrival_times(50, 5.0, seed=3) != arrival_times(50, 5.0, seed=4)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_times(4, 2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert arrival_times(0, 1.0) == []
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)
