"""Sampler.sample: greedy, distributions, processors, seeds, logprobs (CPU, small vocabularies)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.sampling import Sampler, compute_logprobs
from nxdserve.engine.sampling.processors import ProcessorPlan, apply_processors
from nxdserve.engine.sampling.rows import RowParams, SlotTables
from nxdserve.engine.sampling.truncation import restrict_support
from nxdserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
# Full sort only, and tiny candidate sets that force every fallback (the default ladder is a sort at V=12).
LADDERS = [(), (2, 4)]


def make_batch(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    stop_ids: list[list[int]] | None = None,
    max_model_len: int = 64,
) -> PersistentBatch:
    batch = PersistentBatch(len(params), max_model_len, max_spec_tokens=4)
    for slot, p in enumerate(params):
        prompt = prompts[slot] if prompts else [1, 2, 3]
        batch.add(slot, f"r{slot}", prompt, p, stop_ids[slot] if stop_ids else [])
    return batch


def expected_probs(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """Reference: vLLM's min-p -> top-k -> top-p on the temperature-scaled distribution."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones_like(p, dtype=bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if 0 < top_k < len(p):
        kth = np.sort(np.where(keep, z, -np.inf))[::-1][top_k - 1]
        keep &= z >= kth
    if top_p < 1:
        masked = np.where(keep, p, 0.0)
        masked /= masked.sum()
        order = np.argsort(-masked, kind="stable")
        before = np.concatenate([[0.0], np.cumsum(masked[order])[:-1]])
        kept = np.zeros_like(keep)
        kept[order[before < top_p]] = True
        keep &= kept
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def empirical(tokens: torch.Tensor, vocab: int) -> np.ndarray:
    return np.bincount(tokens.numpy(), minlength=vocab) / tokens.numel()


def tv(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())


# -- greedy ----------------------------------------------------------------------------------------
def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    torch.manual_seed(0)
    batch = make_batch([SamplingParams(temperature=0.0)] * 6)
    logits = torch.randn(6, 100)
    before = logits.clone()
    out = Sampler(100, CPU).sample(logits, np.arange(6), batch)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None
    assert torch.equal(logits, before)
    bf16 = logits.bfloat16()
    assert torch.equal(Sampler(100, CPU).sample(bf16, np.arange(6), batch).token_ids, bf16.float().argmax(-1))


def test_greedy_rows_in_a_mixed_batch_stay_argmax() -> None:
    torch.manual_seed(1)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_p=0.8) for i in range(8)]
    batch = make_batch(params)
    logits = torch.randn(8, 50)
    before = logits.clone()
    out = Sampler(50, CPU).sample(logits, np.arange(8), batch)
    assert torch.equal(out.token_ids[1::2], logits[1::2].argmax(-1))
    assert torch.equal(logits, before)


def test_padded_vocabulary_columns_are_never_sampled() -> None:
    batch = make_batch([SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)])
    logits = torch.zeros(2, 40)
    logits[:, 32:] = 100.0  # lm_head padding past the real vocabulary of 32
    out = Sampler(32, CPU).sample(logits, np.arange(2), batch)
    assert (out.token_ids < 32).all()


# -- distributions ---------------------------------------------------------------------------------
DIST_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=1.7, top_k=3),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=0.8, top_k=5, top_p=0.8),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=1.3, min_p=0.05, top_k=6, top_p=0.9),
]


@pytest.mark.parametrize("case", DIST_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("ladder", LADDERS, ids=["sort", "tiny"])
def test_random_sampling_matches_the_exact_distribution(case: dict, ladder: tuple[int, ...] | None) -> None:
    vocab, draws = 12, 40_000
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.3, 0.0, -0.4, -0.9, -1.5, -2.2, -3.0])
    batch = make_batch([SamplingParams(**case)])
    sampler = Sampler(vocab, CPU, seed=123, candidate_ladder=ladder)
    out = sampler.sample(logits.expand(draws, vocab), np.zeros(draws, dtype=np.int64), batch)
    want = expected_probs(logits.numpy(), **case)
    got = empirical(out.token_ids, vocab)
    assert tv(got, want) < 0.012, (got, want)
    assert got[want == 0].sum() == 0  # truncated tokens are never drawn


def test_mixed_parameters_in_one_batch() -> None:
    """Each row follows its own parameters when very different rows share a call."""
    vocab, reps = 10, 12_000
    logits = torch.linspace(1.5, -1.5, vocab)
    cases = [dict(temperature=1.0), dict(temperature=0.7, top_k=2), dict(temperature=1.2, top_p=0.6)]
    batch = make_batch([SamplingParams(**c) for c in cases])
    slots = np.tile(np.arange(len(cases)), reps)
    out = Sampler(vocab, CPU, seed=7).sample(logits.expand(slots.size, vocab), slots, batch)
    for s, case in enumerate(cases):
        got = empirical(out.token_ids[torch.from_numpy(slots == s)], vocab)
        assert tv(got, expected_probs(logits.numpy(), **case)) < 0.02


def test_a_top_k_beyond_any_int_samples_the_whole_vocabulary() -> None:
    """top_k = 2**70 (a client may send it) reaches the per-slot arrays as 'no top-k', not an overflow."""
    vocab, reps = 10, 12_000
    logits = torch.linspace(1.5, -1.5, vocab)
    batch = make_batch([SamplingParams(temperature=1.0, top_k=2**70)])
    slots = np.zeros(reps, dtype=np.int64)
    out = Sampler(vocab, CPU, seed=3).sample(logits.expand(reps, vocab), slots, batch)
    assert tv(empirical(out.token_ids, vocab), expected_probs(logits.numpy(), 1.0)) < 0.02


@pytest.mark.parametrize("ladder", [(), (3, 8), (16,)])
def test_thresholds_keep_exactly_the_reference_support(ladder: tuple[int, ...]) -> None:
    """The top-k/top-p/min-p cut agrees with the reference on many random rows, whatever the ladder."""
    rng = np.random.default_rng(0)
    rows, vocab = 64, 40
    logits = torch.from_numpy(rng.normal(scale=rng.uniform(0.3, 4.0, (rows, 1)), size=(rows, vocab))).float()
    top_k = rng.choice([0, 1, 2, 5, 17, 39, 40, 55], rows)
    top_p = rng.choice([1.0, 0.95, 0.5, 0.2, 0.999], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.01, 0.3], rows).astype(np.float32)
    support = restrict_support(logits, top_k, top_p, min_p, ladder)
    assert support.threshold is not None
    kept = (logits >= support.threshold[:, None]).numpy()
    for r in range(rows):
        want = expected_probs(logits[r].numpy(), 1.0, int(top_k[r]), float(top_p[r]), float(min_p[r])) > 0
        assert (kept[r] == want).all(), r
    if support.cand_rows is not None:  # candidate rows hold their entire support
        assert support.cand_logits is not None and support.cand_ids is not None
        for c, r in enumerate(support.cand_rows):
            ids = support.cand_ids[c][torch.isfinite(support.cand_logits[c])]
            assert set(ids.tolist()) == set(np.flatnonzero(kept[r]).tolist())


# -- processors ------------------------------------------------------------------------------------
def _processed(logits: torch.Tensor, batch: PersistentBatch, slots: np.ndarray) -> torch.Tensor:
    rows = RowParams.gather(batch, slots)
    tables = SlotTables(batch)
    work = logits.clone()
    apply_processors(work, ProcessorPlan.build(rows, tables), rows, tables, batch)
    return work


def test_penalties_change_logits_exactly_as_specified() -> None:
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    batch = make_batch([params, SamplingParams()], prompts=[[1, 2], [1, 2]])
    batch.append(0, [2, 3, 3, 4])  # outputs: 2 once, 3 twice, 4 once; prompt-only: 1
    batch.append(1, [2, 3, 3, 4])
    logits = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.5, 3.0]] * 2)
    out = _processed(logits, batch, np.array([0, 1]))
    # 1: prompt only -> repetition only (-1 * 2); 2: 2/2 - 0.25*1 - 0.5; 3: -2*2 - 0.25*2 - 0.5;
    # 4: 0.5/2 - 0.25 - 0.5; 0 and 5 unseen.
    assert torch.allclose(out[0], torch.tensor([1.0, -2.0, 0.25, -5.0, -0.5, 3.0]))
    assert torch.equal(out[1], logits[1])  # a row without penalties is untouched


def test_penalties_steer_greedy_sampling() -> None:
    batch = make_batch([SamplingParams(temperature=0.0, frequency_penalty=2.0)], prompts=[[5]])
    batch.append(0, [0])
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    assert Sampler(6, CPU).sample(logits, np.array([0]), batch).token_ids.item() == 1


def test_logit_bias() -> None:
    vocab = 6
    logits = torch.zeros(vocab)
    bias = {0: -100.0, 2: 1.0, 5: 0.5}
    batch = make_batch([SamplingParams(temperature=0.0, logit_bias={4: 5.0}), SamplingParams(logit_bias=bias)])
    sampler = Sampler(vocab, CPU, seed=3)
    assert sampler.sample(logits[None], np.array([0]), batch).token_ids.item() == 4
    draws = 40_000
    out = sampler.sample(logits.expand(draws, vocab), np.ones(draws, dtype=np.int64), batch)
    want = torch.softmax(torch.tensor([-100.0, 0, 1.0, 0, 0, 0.5]), -1).numpy()
    assert tv(empirical(out.token_ids, vocab), want) < 0.012
    assert (out.token_ids != 0).all()


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    eos, stop = 0, 3
    params = SamplingParams(temperature=0.0, min_tokens=2)
    batch = make_batch([params, SamplingParams(temperature=0.0)], stop_ids=[[eos, stop], [eos, stop]])
    sampler = Sampler(5, CPU)
    logits = torch.tensor([[9.0, 1.0, 2.0, 8.0, 0.0]] * 2)
    assert sampler.sample(logits, np.arange(2), batch).token_ids.tolist() == [2, 0]
    batch.append(0, [2])  # one output: still below min_tokens
    assert sampler.sample(logits[:1], np.array([0]), batch).token_ids.item() == 2
    batch.append(0, [2])  # two outputs: eos allowed again
    assert sampler.sample(logits[:1], np.array([0]), batch).token_ids.item() == eos


# -- seeds -----------------------------------------------------------------------------------------
def _seeded_run(order: list[int], others: list[SamplingParams], steps: int, ladder: tuple[int, ...] | None) -> list:
    """Tokens of the seed-42 request over ``steps`` calls, batched with ``others`` in slot order ``order``."""
    vocab = 300
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=42)
    params = [target, *others]
    batch = make_batch(params)
    sampler = Sampler(vocab, CPU, seed=len(order), candidate_ladder=ladder)
    gen = torch.Generator().manual_seed(0)
    step_logits = [torch.randn(vocab, generator=gen) * 3 for _ in range(steps)]
    got = []
    for step in range(steps):
        noise = torch.randn(len(order), vocab)  # the other rows' logits differ run to run
        logits = torch.stack([step_logits[step] if s == 0 else noise[i] for i, s in enumerate(order)])
        out = sampler.sample(logits, np.array(order), batch)
        got.append(int(out.token_ids[order.index(0)]))
        for i, s in enumerate(order):
            batch.append(s, [int(out.token_ids[i])])
    return got


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    alone = _seeded_run([0], [], steps=6, ladder=None)
    others = [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=1.0, top_k=250),  # widens the candidate sets of the whole call
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.6, top_p=0.5),
    ]
    assert _seeded_run([0, 1, 2, 3, 4], others, steps=6, ladder=None) == alone
    assert _seeded_run([4, 2, 0, 3, 1], others, steps=6, ladder=None) == alone
    for ladder in [(), (2, 4), (64,)]:  # candidate race and full race give the same token
        assert _seeded_run([3, 0, 1], others[:3], steps=6, ladder=ladder) == alone
    assert len(set(alone)) > 1


def test_seeded_row_consumes_one_vocab_draw_per_token() -> None:
    vocab, temperature = 64, 0.8
    batch = make_batch([SamplingParams(temperature=temperature, seed=5)])
    sampler = Sampler(vocab, CPU)
    logits = torch.randn(3, vocab)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        got = sampler.sample(logits[step : step + 1], np.array([0]), batch).token_ids.item()
        q = -torch.empty(vocab).uniform_(generator=gen).log()
        assert got == int((torch.softmax(logits[step] / temperature, -1) / q).argmax())


# -- logprobs --------------------------------------------------------------------------------------
def test_logprobs_are_raw_with_top_n_and_ranks() -> None:
    torch.manual_seed(4)
    vocab = 30
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=2.0, top_k=4, logprobs=0, logit_bias={7: 9.0}),
        SamplingParams(temperature=1.0),
    ]
    batch = make_batch(params)
    logits = torch.randn(3, vocab).bfloat16()
    out = Sampler(vocab, CPU).sample(logits, np.arange(3), batch)
    lp = out.logprobs
    assert lp is not None
    assert lp.token_ids.shape == (3, 4) and lp.logprobs.shape == (3, 4) and lp.ranks.shape == (3,)
    assert lp.logprobs.dtype == np.float32 and lp.token_ids.dtype == np.int64
    ref = torch.log_softmax(logits.float(), -1).numpy()
    assert (lp.token_ids[:, 0] == out.token_ids.numpy()).all()
    for r in range(3):
        tok = lp.token_ids[r, 0]
        np.testing.assert_allclose(lp.logprobs[r, 0], ref[r, tok], rtol=1e-6)
        top = np.argsort(-ref[r], kind="stable")[:3]
        assert list(lp.token_ids[r, 1:]) == list(top)
        np.testing.assert_allclose(lp.logprobs[r, 1:], ref[r, top], rtol=1e-6)
        assert lp.ranks[r] == int((ref[r] >= ref[r, tok]).sum())


def test_compute_logprobs_any_leading_shape_and_padding() -> None:
    logits = torch.randn(2, 3, 10)
    ids = torch.tensor([[1, 2, -1], [0, -1, -1]])
    block = compute_logprobs(logits, ids, 2)
    assert block.token_ids.shape == (2, 3, 3) and block.ranks.shape == (2, 3)
    assert block.token_ids[0, 2, 0] == -1 and block.logprobs[0, 2, 0] == -np.inf and block.ranks[0, 2] == 0
    ref = torch.log_softmax(logits, -1)
    assert np.isclose(block.logprobs[0, 1, 0], ref[0, 1, 2].item())
    assert (block.token_ids[..., 1] == ref.argmax(-1).numpy()).all()


@pytest.mark.parametrize(
    ("params", "stop_ids", "plain"),
    [
        (SamplingParams(temperature=0.0), [], True),
        (SamplingParams(temperature=0.0, min_tokens=2), [], True),  # no stop ids to hold back: nothing to do
        (SamplingParams(temperature=0.7), [], False),
        (SamplingParams(temperature=0.0, logprobs=2), [], False),
        (SamplingParams(temperature=0.0, logit_bias={3: 5.0}), [], False),
        (SamplingParams(temperature=0.0, presence_penalty=0.5), [], False),
        (SamplingParams(temperature=0.0, frequency_penalty=0.5), [], False),
        (SamplingParams(temperature=0.0, repetition_penalty=1.2), [], False),
        (SamplingParams(temperature=0.0, min_tokens=2), [0], False),
    ],
)
def test_the_batch_marks_plain_greedy_slots_as_the_sampler_s_general_checks_do(
    params: SamplingParams, stop_ids: list[int], plain: bool
) -> None:
    """``PersistentBatch.plain_greedy`` (the sampler's shortcut) agrees with the general path's own test of the
    same rows (greedy, no logprobs, an empty processor plan), and a freed slot is not plain."""
    batch = make_batch([params], stop_ids=[stop_ids])
    slots = np.array([0])
    rows = RowParams.gather(batch, slots)
    general = bool(rows.greedy.all()) and int(rows.num_logprobs.max()) < 0
    general = general and ProcessorPlan.build(rows, SlotTables(batch)).empty
    assert bool(batch.plain_greedy[0]) == plain == general
    batch.remove(0)
    assert not batch.plain_greedy[0]


def test_plain_greedy_rows_take_the_argmax_and_a_mixed_batch_the_general_path() -> None:
    """Rows that are all plain greedy get the first maximum of each row (the general path's tokens); one row
    wanting logprobs in the same step sends the whole step through the general path, which returns them."""
    torch.manual_seed(0)
    logits = torch.randn(3, 12)
    logits[1, 4] = logits[1, 7] = logits[1].max() + 1.0  # a tie: the first maximum wins
    greedy = SamplingParams(temperature=0.0)
    sampler = Sampler(12, CPU)
    batch = make_batch([greedy, greedy, greedy])
    out = sampler.sample(logits, np.arange(3), batch)
    assert out.token_ids.tolist() == [int(logits[0].argmax()), 4, int(logits[2].argmax())] and out.logprobs is None
    mixed = make_batch([greedy, SamplingParams(temperature=0.0, logprobs=1), greedy])
    out = sampler.sample(logits, np.arange(3), mixed)
    assert out.token_ids.tolist()[1] == 4 and out.logprobs is not None
