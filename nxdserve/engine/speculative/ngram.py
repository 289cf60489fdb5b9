"""N-gram (prompt lookup) proposer: drafts are the tokens that followed an earlier copy of the suffix.

For each request, find the longest n in [prompt_lookup_min, prompt_lookup_max] such that the last n
tokens occurred earlier in the request's own tokens (prompt + output), take the earliest such
occurrence and propose the (up to k) tokens that followed it. This is vLLM's NgramProposer rule; it
costs no model work and pays off whenever the output copies its input (editing, summarising with
quotes, code refactors, RAG answers).

The match runs as numpy over the persistent batch's ``token_ids`` rows, all requests at once: for
every candidate end position i it counts how many trailing tokens agree with the row's suffix
(one vectorised comparison per suffix offset, at most ``prompt_lookup_max`` of them), so the cost
is O(rows x context x max_n) array work with no per-token Python loop.
"""

from __future__ import annotations

import numpy as np

from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.speculative.base import DraftRows, SpeculativeProposer
from nxdserve.engine.speculative.config import SpeculativeConfig


def find_ngram_drafts(
    token_ids: np.ndarray,
    num_tokens: np.ndarray,
    k: np.ndarray,
    min_n: int,
    max_n: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt-lookup drafts for R rows at once.

    ``token_ids`` (R, L) holds each row's tokens in its first ``num_tokens[r]`` columns (anything after
    is ignored); ``k`` (R,) is each row's draft limit. Returns ``(drafts, lengths)``: drafts (R, max k)
    int64 padded with -1, and lengths (R,) int64 (0 where no n-gram of length >= min_n recurs).
    """
    token_ids = np.asarray(token_ids)
    num_tokens = np.asarray(num_tokens, dtype=np.int64)
    k = np.asarray(k, dtype=np.int64)
    num_rows, width = token_ids.shape
    k_max = int(k.max(initial=0))
    drafts = np.full((num_rows, max(k_max, 0)), -1, dtype=np.int64)
    lengths = np.zeros(num_rows, dtype=np.int64)
    if num_rows == 0 or k_max <= 0 or width < 2:
        return drafts, lengths

    rows = np.arange(num_rows)
    # A match may end at i <= N - 2 only, so at least one known token follows it.
    alive = np.arange(width)[None, :] <= (num_tokens - 2)[:, None]
    alive &= (k > 0)[:, None]
    run = np.zeros((num_rows, width), dtype=np.int32)  # trailing tokens that agree with the suffix, capped
    equal = np.empty((num_rows, width), dtype=bool)
    for j in range(min(max_n, width)):
        # Offset j: does the token j before candidate end i equal the token j before the row's end?
        suffix_pos = num_tokens - 1 - j
        suffix_tok = token_ids[rows, np.maximum(suffix_pos, 0)]
        equal[:, :j] = False
        np.equal(token_ids[:, : width - j], suffix_tok[:, None], out=equal[:, j:])
        alive &= equal
        alive &= (suffix_pos >= 0)[:, None]
        if not alive.any():
            break
        run += alive

    usable = np.where(run >= min_n, run, 0)
    best = usable.max(axis=1)  # longest n in [min_n, max_n] (run is capped at max_n by the loop)
    has_match = best > 0
    if not has_match.any():
        return drafts, lengths
    # Earliest occurrence of the longest match: the first i whose run reaches it.
    end = np.argmax(usable == best[:, None], axis=1)
    start = end + 1
    lengths = np.where(has_match, np.minimum(k, num_tokens - start), 0)
    cols = np.arange(k_max)[None, :]
    take = cols < lengths[:, None]
    src = np.minimum(start[:, None] + cols, width - 1)
    drafts = np.where(take, token_ids[rows[:, None], src], -1)
    return drafts.astype(np.int64, copy=False), lengths.astype(np.int64, copy=False)


class NgramProposer(SpeculativeProposer):
    """Prompt lookup over each request's own tokens; no model, no per-slot state."""

    method = "ngram"

    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(spec, max_model_len)
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max

    def draft(self, rows: DraftRows, batch: PersistentBatch) -> tuple[np.ndarray, np.ndarray]:
        width = int(rows.num_tokens.max())
        context = batch.token_ids[rows.slots, :width]
        return find_ngram_drafts(context, rows.num_tokens, rows.k, self.min_n, self.max_n)
