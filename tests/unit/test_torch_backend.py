"""TorchBackend.execute on hand-built plans over a tiny Llama, checked against transformers (fp32)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

import numpy as np
import pytest
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.torch_backend import TorchBackend
from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.step import NewRequest, StepPlan, StepResult
from nxdserve.sampling_params import SamplingParams
from tests.helpers.tiny_model import VOCAB_SIZE, reference_model, single_torch_thread, tiny_model_path

MAX_LEN = 64
NUM_SLOTS = 4
MAX_SPEC = 3


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


def ref_logits(ids: list[int]) -> torch.Tensor:
    return _ref_logits(tuple(ids))


@cache
def _ref_logits(ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return reference_model(tiny_model_path("llama"))(torch.tensor([ids])).logits[0]


def ref_greedy(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(ref_logits(ids)[-1].argmax()))
    return ids[len(prompt) :]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    config = EngineConfig(
        model=str(tiny_model_path("llama")),
        backend="torch",
        dtype="float32",
        max_model_len=MAX_LEN,
        max_num_seqs=NUM_SLOTS,
        seed=0,
    ).resolve(model_max_positions=512)
    return TorchBackend(tiny_model_path("llama"), config)


@pytest.fixture
def batch(backend: TorchBackend) -> PersistentBatch:
    _new.clear()
    return backend.bind(NUM_SLOTS, MAX_LEN, MAX_SPEC)  # a fresh batch per test: every slot free


_new: list[NewRequest] = []  # admissions for the next plan, as the scheduler would send them


def add(batch: PersistentBatch, slot: int, ids: list[int], **params: object) -> None:
    _new.append(NewRequest(slot, f"req-{slot}", ids, SamplingParams(temperature=0.0, **params), []))  # type: ignore[arg-type]


def make_plan(rows: list[tuple[int, int, int, int, bool]], drafts: dict[int, list[int]] | None = None) -> StepPlan:
    """rows: (slot, start_pos, num_scheduled, num_drafts, sample), sorted by slot; drafts: slot -> its drafts.
    The plan carries the admissions queued by ``add`` since the previous one."""
    a = np.array(sorted(rows), dtype=np.int64).reshape(-1, 5)
    plan = StepPlan(
        slots=a[:, 0], start_pos=a[:, 1], num_scheduled=a[:, 2], num_drafts=a[:, 3], sample=a[:, 4].astype(bool)
    )
    plan.new_requests = list(_new)
    _new.clear()
    if drafts:
        table = np.full((plan.num_rows, MAX_SPEC), -1, dtype=np.int64)
        for r, slot in enumerate(plan.slots.tolist()):
            table[r, : len(drafts.get(slot, []))] = drafts.get(slot, [])
        plan.draft_token_ids = table
    return plan


def run_greedy(
    backend: TorchBackend, batch: PersistentBatch, prompts: dict[int, list[int]], num_new: int, chunk: int
) -> dict[int, list[int]]:
    """A minimal scheduler: every step each slot runs up to ``chunk`` uncomputed tokens, so slots with
    different prompt lengths mix prefill chunks and decodes in one forward."""
    for slot, ids in prompts.items():
        add(batch, slot, ids)
    num_tokens = {slot: len(ids) for slot, ids in prompts.items()}
    computed = dict.fromkeys(prompts, 0)
    outputs: dict[int, list[int]] = {s: [] for s in prompts}
    while any(len(o) < num_new for o in outputs.values()):
        rows = []
        for s in prompts:
            if len(outputs[s]) >= num_new:
                continue
            n = min(chunk, num_tokens[s] - computed[s])
            rows.append((s, computed[s], n, 0, computed[s] + n == num_tokens[s]))
        result = backend.execute(make_plan(rows))
        for r, (s, _, n, _, _) in enumerate(sorted(rows)):
            computed[s] += n
            if result.num_sampled[r]:
                outputs[s].append(int(result.sampled_token_ids[r, 0]))
                num_tokens[s] += 1
    for s in prompts:  # the backend appended each sampled token to its own batch
        assert batch.token_ids[s, len(prompts[s]) : num_tokens[s]].tolist() == outputs[s]
        assert batch.num_tokens[s] == num_tokens[s]
    return outputs


def test_capabilities(backend: TorchBackend) -> None:
    caps = backend.capabilities
    assert caps.vocab_size == VOCAB_SIZE
    assert caps.max_model_len == MAX_LEN and caps.max_prompt_len == MAX_LEN - 1
    assert caps.max_num_seqs == NUM_SLOTS
    assert caps.mixed_prefill_decode and caps.chunked_prefill
    assert caps.eos_token_ids == (2,)
    assert backend.dtype == torch.float32 and backend.model is backend.runner.model


@pytest.mark.parametrize("chunk", [64, 5])
def test_greedy_generation_matches_transformers(backend: TorchBackend, batch: PersistentBatch, chunk: int) -> None:
    prompts = {0: prompt(11, 1), 1: prompt(23, 2), 3: prompt(4, 3)}
    got = run_greedy(backend, batch, prompts, num_new=6, chunk=chunk)
    for s, ids in prompts.items():
        assert got[s] == ref_greedy(ids, 6), f"slot {s}"


def test_non_final_chunk_samples_nothing(backend: TorchBackend, batch: PersistentBatch) -> None:
    add(batch, 1, prompt(20, 4))
    result = backend.execute(make_plan([(1, 0, 8, 0, False)]))
    assert result.sampled_token_ids.tolist() == [[-1]] and result.num_sampled.tolist() == [0]
    assert result.logprobs is None and result.prompt_logprobs is None
    assert set(result.timings) == {"prepare", "forward", "sample"}
    assert result.hidden_states is None and result.token_hidden_states is None


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_verification_accepts_correct_drafts(
    backend: TorchBackend, batch: PersistentBatch, with_draft_probs: bool
) -> None:
    """Row 0 drafts the true greedy continuation (all accepted + a bonus token); row 1 drafts a wrong
    second token (one accepted, then the correction); row 2 is a plain decode in the same forward.
    Greedy rows ignore draft probabilities, which only have to reach the sampler in the right shape."""
    p0, p1, p2 = prompt(9, 5), prompt(14, 6), prompt(7, 7)
    for slot, ids in ((0, p0), (1, p1), (2, p2)):
        add(batch, slot, ids)
    backend.execute(make_plan([(0, 0, 8, 0, False), (1, 0, 13, 0, False), (2, 0, 6, 0, False)]))
    truth0, truth1 = ref_greedy(p0, 4), ref_greedy(p1, 3)
    drafts = {0: truth0[:3], 1: [truth1[0], (truth1[1] + 1) % VOCAB_SIZE]}
    plan = make_plan([(0, 8, 4, 3, True), (1, 13, 3, 2, True), (2, 6, 1, 0, True)], drafts)
    if with_draft_probs:
        plan.draft_probs = torch.full((3, MAX_SPEC, VOCAB_SIZE), 1.0 / VOCAB_SIZE)
    result = backend.execute(plan)
    assert result.sampled_token_ids.shape == (3, 4)
    assert result.num_sampled.tolist() == [4, 2, 1]
    assert result.sampled_token_ids[0].tolist() == truth0
    assert result.sampled_token_ids[1, :2].tolist() == truth1[:2]
    assert result.sampled_token_ids[2, 0] == ref_greedy(p2, 1)[0]


def test_prompt_logprobs_across_chunks(backend: TorchBackend, batch: PersistentBatch) -> None:
    ids = prompt(20, 8)
    add(batch, 2, ids, prompt_logprobs=2)
    first = backend.execute(make_plan([(2, 0, 12, 0, False)]))
    last = backend.execute(make_plan([(2, 12, 8, 0, True)]))
    assert first.prompt_logprobs is not None and last.prompt_logprobs is not None
    a, b = first.prompt_logprobs[0], last.prompt_logprobs[0]
    assert a.token_ids.shape == (12, 3) and b.token_ids.shape == (7, 3)  # positions 0..18 predict 1..19
    ref = torch.log_softmax(ref_logits(ids), dim=-1)
    chosen = np.concatenate([a.logprobs[:, 0], b.logprobs[:, 0]])
    assert np.concatenate([a.token_ids[:, 0], b.token_ids[:, 0]]).tolist() == ids[1:]
    np.testing.assert_allclose(chosen, ref[torch.arange(19), torch.tensor(ids[1:])].numpy(), atol=1e-4)
    assert a.token_ids[:, 1].tolist() == ref[:12].argmax(-1).tolist()


def test_sample_logprobs_and_hidden_states(backend: TorchBackend, batch: PersistentBatch) -> None:
    p0, p3 = prompt(10, 9), prompt(6, 10)
    add(batch, 0, p0, logprobs=3)
    add(batch, 3, p3, logprobs=3)
    backend.keep_hidden_states = True
    try:
        result: StepResult = backend.execute(make_plan([(0, 0, 10, 0, True), (3, 0, 4, 0, False)]))
    finally:
        backend.keep_hidden_states = False
    assert result.logprobs is not None
    assert result.logprobs.token_ids.shape == (2, 1, 4)
    ref = torch.log_softmax(ref_logits(p0)[-1], dim=-1)
    token = int(result.sampled_token_ids[0, 0])
    assert token == int(ref.argmax()) and result.logprobs.token_ids[0, 0, 0] == token
    np.testing.assert_allclose(result.logprobs.logprobs[0, 0, 0], ref[token].item(), atol=1e-4)
    assert result.logprobs.ranks[0, 0] == 1 and result.logprobs.token_ids[1, 0, 0] == -1
    hidden = result.hidden_states
    assert hidden is not None and result.token_hidden_states is not None and result.token_offsets is not None
    assert hidden.shape == (2, 1, 64)
    with torch.no_grad():
        out = reference_model(tiny_model_path("llama"))(torch.tensor([p0]), output_hidden_states=True)
    torch.testing.assert_close(hidden[0, 0], out.hidden_states[-1][0, -1], atol=1e-4, rtol=0)
    assert result.token_hidden_states.shape == (14, 64) and result.token_offsets.tolist() == [0, 10, 14]


def test_bind_rejects_a_larger_batch(backend: TorchBackend) -> None:
    from nxdserve.errors import ConfigError

    with pytest.raises(ConfigError):
        backend.bind(NUM_SLOTS + 1, MAX_LEN, 0)


def test_plan_diffs_free_before_they_admit(backend: TorchBackend, batch: PersistentBatch) -> None:
    """A slot freed and taken again between two plans: the plan frees it first, then writes the new prompt."""
    first, second = prompt(5, 11), prompt(7, 12)
    add(batch, 1, first, logprobs=2)
    backend.execute(make_plan([(1, 0, 5, 0, True)]))
    assert batch.request_ids[1] == "req-1" and batch.num_tokens[1] == 6 and batch.num_logprobs[1] == 2
    add(batch, 1, second)
    plan = make_plan([(1, 0, 7, 0, True)])
    plan.freed_slots = [1]
    result = backend.execute(plan)
    assert batch.num_prompt_tokens[1] == 7 and batch.num_tokens[1] == 8 and batch.num_logprobs[1] == -1
    assert batch.token_ids[1, :8].tolist() == [*second, int(result.sampled_token_ids[0, 0])]
    freed = make_plan([])
    freed.freed_slots = [1]
    backend.execute(freed)  # an empty plan still applies its diffs
    assert not batch.active.any() and batch.num_tokens[1] == 0


def _decode_run(backend: TorchBackend, batch: PersistentBatch, steps: int) -> list[StepResult]:
    """Three slots with different sampling (plain greedy; seeded sampling with logprobs; greedy with a
    repetition penalty) prefilled together, then ``steps`` decode steps of all three."""
    prompts = {0: prompt(9, 21), 2: prompt(5, 22), 3: prompt(12, 23)}
    add(batch, 0, prompts[0])
    _new.append(NewRequest(2, "req-2", prompts[2], SamplingParams(temperature=0.9, seed=7, logprobs=2), []))
    add(batch, 3, prompts[3], repetition_penalty=1.5)
    results = [backend.execute(make_plan([(s, 0, len(p), 0, True) for s, p in prompts.items()]))]
    for _ in range(steps):
        rows = [(s, int(batch.num_tokens[s]) - 1, 1, 0, True) for s in prompts]
        results.append(backend.execute(make_plan(rows)))
    return results


def test_decode_steps_take_the_lean_path_with_the_general_paths_results(
    backend: TorchBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All-decode plans run ``_execute_decode``; the same steps through the general path give the same tokens,
    logprobs and batch contents."""
    lean_calls: list[int] = []
    lean = TorchBackend._execute_decode

    def counted(self: TorchBackend, *args: object) -> StepResult:
        lean_calls.append(1)
        return lean(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(TorchBackend, "_execute_decode", counted)
    runs = []
    for general in (False, True):
        if general:
            monkeypatch.setattr(TorchBackend, "_plain_decode", lambda self, plan: False)
        _new.clear()
        batch = backend.bind(NUM_SLOTS, MAX_LEN, MAX_SPEC)
        runs.append((_decode_run(backend, batch, steps=6), batch.token_ids.copy(), batch.num_tokens.copy()))
    assert len(lean_calls) == 6  # the decode steps of the first run, not its prefill nor the second run
    (fast, fast_ids, fast_len), (slow, slow_ids, slow_len) = runs
    np.testing.assert_array_equal(fast_ids, slow_ids)
    np.testing.assert_array_equal(fast_len, slow_len)
    for a, b in zip(fast, slow, strict=True):
        np.testing.assert_array_equal(a.sampled_token_ids, b.sampled_token_ids)
        np.testing.assert_array_equal(a.num_sampled, b.num_sampled)
        assert a.logprobs is not None and b.logprobs is not None
        np.testing.assert_array_equal(a.logprobs.token_ids, b.logprobs.token_ids)
        np.testing.assert_array_equal(a.logprobs.logprobs, b.logprobs.logprobs)
        np.testing.assert_array_equal(a.logprobs.ranks, b.logprobs.ranks)
        assert set(a.timings) == set(b.timings)
    assert len(set(fast[-1].sampled_token_ids[:, 0].tolist())) > 1  # the rows did sample different tokens


def test_greedy_decode_rows_alone_get_no_logprobs(backend: TorchBackend, batch: PersistentBatch) -> None:
    """The lean path's plain-greedy rows: tokens as transformers' greedy, no logprobs block."""
    ids = prompt(7, 24)
    add(batch, 1, ids)
    out = [int(backend.execute(make_plan([(1, 0, 7, 0, True)])).sampled_token_ids[0, 0])]
    for step in range(3):
        result = backend.execute(make_plan([(1, 7 + step, 1, 0, True)]))
        assert result.logprobs is None and result.sampled_token_ids.shape == (1, 1)
        out.append(int(result.sampled_token_ids[0, 0]))
    assert out == ref_greedy(ids, 4)
