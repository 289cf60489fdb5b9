"""The emulator reproduces the NxD behaviours an adapter can get wrong, and the backend gets them right.

Each "mistake" test drives the emulated application the wrong way and shows the damage (so the
engine-level comparisons would notice it), next to the right way.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.nxd import NxdBackend
from nxdserve.engine.backends.nxd.inputs import cte_call
from nxdserve.engine.loader import load_model_files, max_positions
from nxdserve.engine.step import NewRequest, StepPlan
from nxdserve.sampling_params import SamplingParams
from tests.helpers.tiny_model import tiny_model_path

LONG = list(range(200, 260))  # 60 tokens
SHORT = list(range(500, 510))  # 10 tokens


def make_backend(num_seqs: int = 2, **overrides: Any) -> NxdBackend:
    config = EngineConfig(model=str(tiny_model_path("llama")), backend="nxd", dtype="float32", max_model_len=256,
                          max_num_seqs=num_seqs, enable_chunked_prefill=False, **overrides)
    files = load_model_files(config)
    config.resolve(max_positions(files.hf_config))
    return NxdBackend(files.path, config)


@pytest.fixture(scope="module")
def backend() -> NxdBackend:
    return make_backend()


def greedy_rows(n: int) -> torch.Tensor:
    return torch.tensor([[1.0, 1.0, 1.0]] * n)


def cte(app: Any, prompt: list[int], seq: int) -> int:
    out = app(input_ids=torch.tensor([prompt]), position_ids=torch.arange(len(prompt)).view(1, -1),
              seq_ids=torch.tensor([seq]), sampling_params=greedy_rows(1))
    return int(out.tokens[0]) if out.logits is None else int(out.logits[0, -1].argmax())


def tkg(app: Any, rows: list[tuple[int, int, int]]) -> list[int]:
    """rows: (seq_id, token, position) in the order given; on-device greedy tokens."""
    return [int(t) for t in _tkg(app, rows).tokens]


def tkg_logits(app: Any, rows: list[tuple[int, int, int]]) -> torch.Tensor:
    """Like ``tkg`` for an application without on-device sampling: (B, V) logits."""
    return _tkg(app, rows).logits[:, -1]


def _tkg(app: Any, rows: list[tuple[int, int, int]]) -> Any:
    return app(input_ids=torch.tensor([[t] for _, t, _ in rows]), position_ids=torch.tensor([[p] for _, _, p in rows]),
               seq_ids=torch.tensor([s for s, _, _ in rows]), sampling_params=greedy_rows(len(rows)))


def test_routing_dtypes_and_one_prompt_per_context_call(backend: NxdBackend) -> None:
    app = backend.app
    seen: list[torch.dtype] = []
    traced = app.context_encoding_model.traced
    app.context_encoding_model.traced = lambda *a: seen.extend(x.dtype for x in a[:4]) or traced(*a)
    try:
        cte(app, SHORT, 1)
    finally:
        app.context_encoding_model.traced = traced
    assert set(seen) == {torch.int32}  # int64 inputs arrive as int32
    assert app.calls[-1]["tag"] == "context_encoding_model"
    tkg(app, [(1, 5, len(SHORT))])
    assert app.calls[-1]["tag"] == "token_generation_model"


def test_length_errors_are_nxds(backend: NxdBackend) -> None:
    app = backend.app
    with pytest.raises(ValueError, match="exceeds largest bucket"):
        cte(app, [5] * 257, 0)
    with pytest.raises(ValueError, match="exceeds largest bucket"):
        tkg(app, [(0, 5, 257), (1, 5, 3)])


def test_sampling_params_are_validated(backend: NxdBackend) -> None:
    app = backend.app
    args = {"input_ids": torch.tensor([SHORT]), "position_ids": torch.arange(10).view(1, -1),
            "seq_ids": torch.tensor([0])}
    with pytest.raises(ValueError, match="shape"):
        app(**args, sampling_params=torch.ones(1, 2))
    with pytest.raises(ValueError, match="global_top_k=256"):
        app(**args, sampling_params=torch.tensor([[300.0, 1.0, 1.0]]))
    with pytest.raises(ValueError, match="Temperature = 0"):
        app(**args, sampling_params=torch.tensor([[0.0, 1.0, 0.0]]))


def test_a_full_batch_ignores_seq_ids(backend: NxdBackend) -> None:
    app = backend.app
    first = [cte(app, LONG, 0), cte(app, SHORT, 1)]
    right = tkg(app, [(0, first[0], len(LONG)), (1, first[1], len(SHORT))])
    first = [cte(app, LONG, 0), cte(app, SHORT, 1)]  # rewrite both lines
    wrong = tkg(app, [(1, first[1], len(SHORT)), (0, first[0], len(LONG))])  # unsorted: row i is line i
    assert wrong[::-1] != right


@pytest.mark.parametrize("mask", [False, True], ids=["pad-rows-write", "seq-ids-mask"])
def test_a_partial_batch_pads_into_other_lines(mask: bool) -> None:
    override: dict[str, Any] = {"on_device_sampling_config": None, "apply_seq_ids_mask": mask}
    app = make_backend(override_neuron_config=override).app
    a, b = cte(app, LONG, 0), cte(app, SHORT, 1)
    right = tkg_logits(app, [(0, a, len(LONG)), (1, b, len(SHORT))])[0]
    a, b = cte(app, LONG, 0), cte(app, SHORT, 1)
    tkg_logits(app, [(1, b, len(SHORT))])  # its pad row writes line 0 at position 10, inside LONG's prompt
    after = tkg_logits(app, [(0, a, len(LONG)), (1, b, len(SHORT) + 1)])[0]
    assert torch.equal(after, right) is mask


def test_one_token_prompts_need_the_full_bucket(backend: NxdBackend) -> None:
    app = backend.app
    naive = cte(app, [77], 0)  # NxD pads positions with 1 and reads the output at a pad
    call = cte_call(np.array([77]), 0, greedy_rows(1), backend.settings.cte_buckets_largest, 0)
    fixed = int(app(**call.kwargs()).tokens[0])
    reference = backend.app.target  # the same network, run directly
    hidden = reference.run(torch.tensor([77]), np.array([1]), np.array([0]), np.array([1]))
    assert fixed == int(reference.logits(hidden).argmax(-1)[0]) != naive


def _plan(slots: list[int], starts: list[int], lens: list[int]) -> StepPlan:
    n = len(slots)
    return StepPlan(slots=np.array(slots), start_pos=np.array(starts), num_scheduled=np.array(lens),
                    num_drafts=np.zeros(n, dtype=np.int64), sample=np.ones(n, dtype=bool))


@pytest.mark.parametrize("replay", [True, False], ids=["backend", "without-replay"])
def test_backend_keeps_left_out_live_slots_intact(replay: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # CPU sampling with logprobs: the chosen token's logprob shows any change to the KV it read.
    backend = make_backend(num_seqs=3, override_neuron_config={"on_device_sampling_config": None})
    batch = backend.bind(3, 256, 0)  # line 2 stays free, so every decode call is a partial batch
    if not replay:  # the adapter mistake: decode only the planned rows
        monkeypatch.setattr(backend, "_missing_live_slots", lambda slots: np.zeros(0, dtype=np.int64))

    def next_logprob_of_long(leave_out: bool) -> float:
        for slot, prompt in ((0, LONG), (1, SHORT)):
            plan = _plan([slot], [0], [len(prompt)])
            plan.freed_slots = [slot] if batch.active[slot] else []
            plan.new_requests = [NewRequest(slot, str(slot), prompt, SamplingParams(temperature=0.0, logprobs=0), [])]
            backend.execute(plan)  # the backend appends the sampled token to its batch itself
            assert batch.num_tokens[slot] == len(prompt) + 1
        if leave_out:  # a decode step that plans slot 1 only; NxD pads line 0 at SHORT's position
            backend.execute(_plan([1], [len(SHORT)], [1]))
        logprobs = backend.execute(_plan([0], [len(LONG)], [1])).logprobs
        assert logprobs is not None
        return float(logprobs.logprobs[0, 0, 0])

    right = next_logprob_of_long(leave_out=False)
    assert (abs(next_logprob_of_long(leave_out=True) - right) < 1e-5) is replay
