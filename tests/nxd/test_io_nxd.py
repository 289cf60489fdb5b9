"""Input building (sampling rows, context-encoding and token-generation calls) and output conversion."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nxdserve.engine.backends.nxd.inputs import cte_call, sampling_rows, tkg_call
from nxdserve.engine.backends.nxd.outputs import fused_tokens, read_fused, read_logits, read_tokens
from nxdserve.engine.backends.nxd.request_check import cpu_sampling_features
from nxdserve.sampling_params import SamplingParams


def test_sampling_rows_follow_nxd_rules_per_row() -> None:
    rows = sampling_rows(
        temperature=np.array([0.0, 0.7, 1.0, 1.3], dtype=np.float32),
        top_k=np.array([0, 0, 300, 50], dtype=np.int32),
        top_p=np.array([0.5, 0.9, 1.0, 0.8], dtype=np.float32),
        global_topk=256,
    )
    assert rows.dtype == torch.float32 and rows.shape == (4, 3)
    expected = [[1, 1, 1], [256, 0.9, 0.7], [256, 1.0, 1.0], [50, 0.8, 1.3]]
    assert torch.allclose(rows, torch.tensor(expected, dtype=torch.float32))
    raw = sampling_rows(np.array([0.5], dtype=np.float32), np.array([0]), np.array([1.0]), None)
    assert raw.tolist() == [[0.0, 1.0, 0.5]]  # no on-device sampling: passed through


def test_context_encoding_call() -> None:
    params = torch.ones(1, 3)
    call = cte_call(np.array([4, 5, 6]), 3, params, 256, 0)
    assert call.input_ids.tolist() == [[4, 5, 6]] and call.position_ids.tolist() == [[0, 1, 2]]
    assert call.seq_ids.tolist() == [3] and call.kwargs()["attention_mask"] is None
    one = cte_call(np.array([9]), 1, params, 128, 2)
    assert one.input_ids.shape == (1, 128) and one.input_ids[0, 0] == 9 and set(one.input_ids[0, 1:].tolist()) == {2}
    assert set(one.position_ids.flatten().tolist()) == {0}  # no pad may outrank the real token's position


def test_token_generation_call_must_be_sorted() -> None:
    call = tkg_call(np.array([7, 8]), np.array([10, 20]), np.array([0, 2]), torch.ones(2, 3))
    assert call.input_ids.tolist() == [[7], [8]] and call.position_ids.tolist() == [[10], [20]]
    with pytest.raises(AssertionError):
        tkg_call(np.array([7, 8]), np.array([10, 20]), np.array([2, 0]), torch.ones(2, 3))


def test_fused_outputs_to_accepted_tokens() -> None:
    # After context encoding: [tok, -1, ...] and next_pos = prompt length.
    tokens, counts = fused_tokens(np.array([[11, -1, -1, -1]]), np.array([5]), np.array([4]))
    assert tokens.tolist() == [[11, -1, -1, -1]] and counts.tolist() == [1]
    # Token generation: 1..k accepted; whatever follows the count is padding, even if not -1.
    tokens, counts = fused_tokens(np.array([[1, 2, 3, 4], [5, 6, 0, 0], [7, -1, -1, -1]]),
                                  np.array([14, 22, 31]), np.array([10, 20, 30]))
    assert tokens.tolist() == [[1, 2, 3, 4], [5, 6, -1, -1], [7, -1, -1, -1]] and counts.tolist() == [4, 2, 1]
    with pytest.raises(RuntimeError, match="padding inside"):
        fused_tokens(np.array([[1, -1, 3]]), np.array([13]), np.array([10]))
    output = SimpleNamespace(fused_outputs=[
        torch.tensor([[1, 2, -1], [3, -1, -1]], dtype=torch.int32), torch.zeros(2, 1), torch.zeros(2, 8),
        torch.tensor([[12], [31]], dtype=torch.int32),
    ])
    tokens, counts = read_fused(output, np.array([1, 0]), np.array([30, 10]))
    assert tokens.tolist() == [[3, -1, -1], [1, 2, -1]] and counts.tolist() == [1, 2]


def test_read_tokens_and_logits() -> None:
    assert read_tokens(SimpleNamespace(tokens=torch.tensor([3, 4], dtype=torch.int32))).tolist() == [3, 4]
    assert read_tokens(SimpleNamespace(tokens=None, hidden_states=torch.tensor([[5]]))).tolist() == [5]
    logits = read_logits(SimpleNamespace(logits=torch.zeros(2, 1, 10)), vocab_size=8)
    assert logits.shape == (2, 8)  # lm_head vocabulary padding trimmed
    with pytest.raises(RuntimeError, match="no logits"):
        read_logits(SimpleNamespace(logits=None), 8)


def test_features_that_need_cpu_sampling() -> None:
    assert cpu_sampling_features(SamplingParams(temperature=0.7, top_k=20, top_p=0.9)) == []
    assert cpu_sampling_features(SamplingParams(temperature=0.0, seed=3)) == []
    assert cpu_sampling_features(SamplingParams(logprobs=0, min_p=0.1, frequency_penalty=0.5, seed=3)) == [
        "logprobs", "min_p", "frequency_penalty", "seed"
    ]
