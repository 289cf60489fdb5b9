"""The vectorised prompt-lookup matcher against a plain-Python reference of vLLM's rule."""

from __future__ import annotations

import numpy as np
import pytest

from nxdserve.engine.speculative.ngram import find_ngram_drafts


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest suffix n-gram (min_n <= n <= max_n) that occurs earlier; earliest occurrence; up to k
    tokens that followed it (only tokens that exist)."""
    n_tok = len(tokens)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        suffix = tokens[n_tok - n :]
        for start in range(0, n_tok - n):  # the match must end before the last token
            if tokens[start : start + n] == suffix:
                follow = start + n
                return tokens[follow : min(follow + k, n_tok)]
    return []


def test_examples() -> None:
    rows = np.array([
        [1, 2, 3, 4, 1, 2, 3, 9, 9, 1, 2, 3],
        [5, 6, 7, 5, 6, 7, 5, 6, 7, 0, 0, 0],
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0],
    ])
    drafts, lengths = find_ngram_drafts(rows, np.array([12, 9, 9]), np.array([3, 5, 2]), 2, 3)
    assert lengths.tolist() == [3, 5, 0]
    assert drafts[0, :3].tolist() == [4, 1, 2]  # earliest "1 2 3", not the later one followed by 9
    assert drafts[1].tolist() == [5, 6, 7, 5, 6]  # a match may run into the suffix itself
    assert (drafts[2] == -1).all()


def test_longest_match_wins_over_earlier_shorter() -> None:
    tokens = [7, 3, 50, 1, 2, 3, 60, 2, 3]  # "3" occurs at 1, but "2 3" (longer) first occurs at 4-5
    drafts, lengths = find_ngram_drafts(np.array([tokens]), np.array([9]), np.array([2]), 1, 3)
    assert drafts[0, : lengths[0]].tolist() == [60, 2] == reference(tokens, 2, 1, 3)


def test_drafts_stop_at_known_tokens_and_k() -> None:
    tokens = [4, 5, 6, 4, 5]  # match "4 5" at 0; followers 6, 4, 5 (3 known)
    drafts, lengths = find_ngram_drafts(np.array([tokens]), np.array([5]), np.array([8]), 2, 2)
    assert drafts[0, : lengths[0]].tolist() == [6, 4, 5]
    _, lengths = find_ngram_drafts(np.array([tokens]), np.array([5]), np.array([0]), 2, 2)
    assert lengths.tolist() == [0]


def test_short_contexts_and_empty_batch() -> None:
    drafts, lengths = find_ngram_drafts(np.zeros((0, 4), dtype=np.int64), np.zeros(0), np.zeros(0), 1, 3)
    assert drafts.shape[0] == 0 and lengths.shape == (0,)
    _, lengths = find_ngram_drafts(np.array([[3, 3, 0]]), np.array([1]), np.array([4]), 1, 3)
    assert lengths.tolist() == [0]  # one token: nothing can precede the suffix
    drafts, lengths = find_ngram_drafts(np.array([[3, 3, 0]]), np.array([2]), np.array([4]), 1, 3)
    assert drafts[0, : lengths[0]].tolist() == [3]


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 5), (5, 5)])
def test_matches_reference_on_random_rows(min_n: int, max_n: int) -> None:
    rng = np.random.default_rng(min_n * 10 + max_n)
    num_rows, width = 40, 60
    # A tiny alphabet makes repeats (and ties between occurrences) common.
    tokens = rng.integers(0, 4, size=(num_rows, width))
    num_tokens = rng.integers(1, width + 1, size=num_rows)
    k = rng.integers(0, 7, size=num_rows)
    drafts, lengths = find_ngram_drafts(tokens, num_tokens, k, min_n, max_n)
    for r in range(num_rows):
        expected = reference(tokens[r, : num_tokens[r]].tolist(), int(k[r]), min_n, max_n) if k[r] > 0 else []
        assert drafts[r, : lengths[r]].tolist() == expected, f"row {r}"
        assert (drafts[r, lengths[r] :] == -1).all()
