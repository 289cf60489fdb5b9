"""Sampler.verify: greedy prefixes, rejection sampling keeps the target distribution, seeds, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.sampling import Sampler
from nxdserve.sampling_params import SamplingParams

CPU = torch.device("cpu")


def make_batch(params: list[SamplingParams], stop_ids: list[list[int]] | None = None) -> PersistentBatch:
    batch = PersistentBatch(len(params), max_model_len=64, max_spec_tokens=4)
    for slot, p in enumerate(params):
        batch.add(slot, f"r{slot}", [1, 2, 3], p, stop_ids[slot] if stop_ids else [])
    return batch


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def tv(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())


def freq(tokens: np.ndarray, vocab: int) -> np.ndarray:
    return np.bincount(tokens, minlength=vocab) / max(tokens.size, 1)


# -- greedy ----------------------------------------------------------------------------------------
def test_greedy_accepts_the_matching_prefix_then_one_target_token() -> None:
    torch.manual_seed(0)
    n, width, vocab = 5, 4, 20
    batch = make_batch([SamplingParams(temperature=0.0)] * n)
    logits = torch.randn(n, width, vocab)
    best = logits.argmax(-1)  # (n, width)
    drafts = best[:, :3].clone()
    drafts[1, 1] = (best[1, 1] + 1) % vocab  # row 1: mismatch at position 1
    drafts[2, 0] = (best[2, 0] + 1) % vocab  # row 2: mismatch at position 0
    num_drafts = torch.tensor([3, 3, 3, 0, 2])  # row 3: plain decode, row 4: two drafts, both match
    out = Sampler(vocab, CPU).verify(logits, drafts, num_drafts, np.arange(n), batch, None)
    assert out.num_tokens.tolist() == [4, 2, 1, 1, 3]
    expected = [
        best[0].tolist(),  # all matched + bonus at position 3
        [best[1, 0].item(), best[1, 1].item(), -1, -1],  # the target's token at the mismatch
        [best[2, 0].item(), -1, -1, -1],
        [best[3, 0].item(), -1, -1, -1],
        [*best[4, :3].tolist(), -1],  # bonus from position num_drafts = 2
    ]
    assert out.token_ids.tolist() == expected
    assert out.logprobs is None


def test_greedy_fast_path_equals_the_general_path() -> None:
    """All-greedy rows without processors or logprobs skip the per-position machinery; asking for
    logprobs sends the same rows through the general path, which must pick the same tokens."""
    gen = torch.Generator().manual_seed(5)
    n, width, vocab = 7, 4, 30
    logits = torch.randn(n, width, vocab, generator=gen)
    best = logits.argmax(-1)
    drafts = best[:, :3].clone()
    flip = torch.rand(n, 3, generator=gen) < 0.3  # random mismatches anywhere in the chains
    drafts[flip] = (drafts[flip] + 1) % vocab
    num_drafts = torch.tensor([3, 2, 0, 1, 3, 3, 2])
    fast = Sampler(vocab, CPU).verify(logits, drafts, num_drafts, np.arange(n),
                                      make_batch([SamplingParams(temperature=0.0)] * n), None)
    general = Sampler(vocab, CPU).verify(logits, drafts, num_drafts, np.arange(n),
                                         make_batch([SamplingParams(temperature=0.0, logprobs=0)] * n), None)
    assert fast.logprobs is None and general.logprobs is not None
    assert fast.token_ids.tolist() == general.token_ids.tolist()
    assert fast.num_tokens.tolist() == general.num_tokens.tolist()
    assert len(set(fast.num_tokens.tolist())) > 1  # the case mixes accepted lengths


def test_greedy_verification_equals_sequential_decoding_with_penalties_and_min_tokens() -> None:
    """Drafts join the history of later positions (penalties) and count as outputs (min_tokens)."""
    vocab = 6
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=2.0),
        SamplingParams(temperature=0.0, min_tokens=2),
    ]
    stops = [[], [0]]
    row_logits = torch.tensor([[0.0, 5.0, 4.5, 4.0, 0.0, 0.0], [9.0, 1.0, 2.0, 0.0, 0.0, 0.0]])
    width = 4
    logits = row_logits[:, None, :].expand(2, width, vocab).contiguous()

    # Sequential reference: one sample() per token.
    seq_batch = make_batch(params, stops)
    sampler = Sampler(vocab, CPU)
    sequential: list[list[int]] = [[], []]
    for _ in range(width):
        out = sampler.sample(row_logits, np.arange(2), seq_batch)
        for s in range(2):
            sequential[s].append(int(out.token_ids[s]))
            seq_batch.append(s, [int(out.token_ids[s])])
    assert sequential == [[1, 2, 3, 1], [2, 2, 0, 0]]

    batch = make_batch(params, stops)
    drafts = torch.tensor([sequential[0][:3], sequential[1][:3]])
    out = sampler.verify(logits, drafts, torch.tensor([3, 3]), np.arange(2), batch, None)
    assert out.num_tokens.tolist() == [4, 4]
    assert out.token_ids.tolist() == sequential


# -- random: the output distribution is the target's --------------------------------------------------
TARGET = np.array(
    [
        [1.0, 0.5, 0.0, -0.5, -1.0, 0.2],
        [-1.0, 0.0, 1.5, 0.3, 0.3, -2.0],
        [0.0, 0.0, 0.0, 1.0, -1.0, 2.0],
    ]
)
DRAFT = softmax(np.array([[-1.0, 1.0, 2.0, 0.0, -3.0, 0.0], [2.0, -1.0, 0.0, 0.0, 1.0, 0.5]]))


def _run_random(point_drafts: bool, params: SamplingParams, target_probs: np.ndarray) -> None:
    n, vocab = 60_000, TARGET.shape[1]
    rng = np.random.default_rng(1)
    num_drafts = rng.choice([0, 1, 2], size=n, p=[0.2, 0.3, 0.5])
    if point_drafts:
        drafts = np.stack([rng.choice(vocab, n), np.full(n, 2)], axis=1)  # uniform ids, then a fixed one
        draft_probs = None
    else:
        drafts = np.stack([rng.choice(vocab, n, p=DRAFT[j]) for j in range(2)], axis=1)
        draft_probs = torch.from_numpy(np.broadcast_to(DRAFT, (n, 2, vocab)).copy()).float()
    logits = torch.from_numpy(np.broadcast_to(TARGET, (n, 3, vocab)).copy()).float()
    batch = make_batch([params])
    out = Sampler(vocab, CPU, seed=11).verify(
        logits, torch.from_numpy(drafts), torch.from_numpy(num_drafts), np.zeros(n, np.int64), batch, draft_probs
    )
    toks, num = out.token_ids.numpy(), out.num_tokens.numpy()
    assert ((num >= 1) & (num <= num_drafts + 1)).all()
    # Every emitted position follows the target at that position, whatever came before.
    for j in range(3):
        emitted = toks[num > j, j]
        assert tv(freq(emitted, vocab), target_probs[j]) < 0.015, j
    # And drafts are accepted as often as the theory says: E[min(1, p/q)] = sum min(p, q).
    judged = num_drafts >= 1
    accepted = (num[judged] >= 2).mean()
    # Point drafts are uniform ids with p_draft = 1: accepted with probability mean_x p(x).
    want = target_probs[0].mean() if point_drafts else np.minimum(target_probs[0], DRAFT[0]).sum()
    assert abs(accepted - want) < 0.01, (accepted, want)


@pytest.mark.parametrize("point_drafts", [False, True], ids=["draft_probs", "point_drafts"])
def test_random_verification_preserves_the_target_distribution(point_drafts: bool) -> None:
    _run_random(point_drafts, SamplingParams(temperature=1.0), softmax(TARGET))


@pytest.mark.parametrize("point_drafts", [False, True], ids=["draft_probs", "point_drafts"])
def test_random_verification_uses_the_processed_target(point_drafts: bool) -> None:
    """The target is softmax(top-k(logits / T)): drafts outside its support are always rejected."""
    scaled = TARGET / 0.7
    kth = np.sort(scaled, axis=-1)[:, -3][:, None]
    target = softmax(np.where(scaled >= kth, scaled, -np.inf))
    _run_random(point_drafts, SamplingParams(temperature=0.7, top_k=3), target)


# -- seeds and mixing ------------------------------------------------------------------------------
def _seeded_verify(order: list[int], others: list[SamplingParams]) -> list[list[int]]:
    vocab = 50
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=99), *others]
    batch = make_batch(params)
    sampler = Sampler(vocab, CPU, seed=len(order))
    gen = torch.Generator().manual_seed(3)
    target_logits = torch.randn(3, vocab, generator=gen)
    target_drafts = torch.randint(0, vocab, (2,), generator=gen)
    results = []
    for step in range(4):
        logits = torch.randn(len(order), 3, vocab)
        drafts = torch.randint(0, vocab, (len(order), 2))
        num_drafts = torch.randint(0, 3, (len(order),))
        i = order.index(0)
        logits[i], drafts[i], num_drafts[i] = target_logits, target_drafts, step % 3
        out = sampler.verify(logits, drafts, num_drafts, np.array(order), batch, None)
        results.append(out.token_ids[i, : out.num_tokens[i]].tolist())
    return results


def test_seeded_verification_is_reproducible_and_independent_of_the_batch() -> None:
    others = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    alone = _seeded_verify([0], [])
    assert _seeded_verify([0], []) == alone
    assert _seeded_verify([2, 0, 3, 1], others) == alone
    assert _seeded_verify([3, 1, 0], others[:3]) == alone


def test_rows_without_drafts_sample_like_sample() -> None:
    """W == 1: verify is sample(); greedy rows match exactly, random rows follow the distribution."""
    vocab, n = 8, 30_000
    batch = make_batch([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.8)])
    logits = torch.linspace(2.0, -2.0, vocab)
    slots = np.tile([0, 1], n // 2)
    out = Sampler(vocab, CPU).verify(
        logits.expand(n, 1, vocab),
        torch.zeros(n, 0, dtype=torch.long),
        torch.zeros(n, dtype=torch.long),
        slots,
        batch,
        None,
    )
    assert out.token_ids.shape == (n, 1) and (out.num_tokens == 1).all()
    assert (out.token_ids[0::2, 0] == 0).all()
    p = softmax(logits.numpy().astype(np.float64))
    order = np.argsort(-p)
    keep = np.concatenate([[0.0], np.cumsum(p[order])[:-1]]) < 0.8
    want = np.zeros(vocab)
    want[order[keep]] = p[order[keep]]
    want /= want.sum()
    assert tv(freq(out.token_ids[1::2, 0].numpy(), vocab), want) < 0.015


def test_verify_logprobs_are_raw_per_position() -> None:
    torch.manual_seed(5)
    vocab = 16
    batch = make_batch([SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=1.0)])
    logits = torch.randn(2, 3, vocab)
    drafts = logits.argmax(-1)[:, :2]
    out = Sampler(vocab, CPU).verify(logits, drafts, torch.tensor([2, 0]), np.arange(2), batch, None)
    lp = out.logprobs
    assert lp is not None and lp.token_ids.shape == (2, 3, 3) and lp.ranks.shape == (2, 3)
    ref = torch.log_softmax(logits, -1)
    assert out.num_tokens.tolist()[0] == 3
    for j in range(3):
        assert lp.ranks[0, j] == 1
        np.testing.assert_allclose(lp.logprobs[0, j, 0], ref[0, j, out.token_ids[0, j]].item(), rtol=1e-6)
        assert list(lp.token_ids[0, j, 1:]) == ref[0, j].topk(2).indices.tolist()
    assert lp.token_ids[1, 1, 0] == -1 and lp.ranks[1, 1] == 0  # padding after row 1's single token
