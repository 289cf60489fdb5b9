"""Prefix caching: a new prompt reuses the KV a free slot still holds for its first tokens."""

from __future__ import annotations

import numpy as np
import pytest

from nxdserve.config import EngineConfig
from nxdserve.engine.request import Request
from nxdserve.sampling_params import SamplingParams
from nxdserve.scheduler.scheduler import Scheduler, _common_prefix_len
from tests.engine.test_scheduler_steps import EOS, Harness, Step
from tests.helpers.counting_backend import CountingBackend
from tests.helpers.engine import PROMPTS, run_to_completion, shared_core, tokenize


def _finish(h: Harness) -> None:
    while h.scheduler.has_unfinished:
        h.step()


@pytest.mark.parametrize("chunked", [True, False])
def test_a_repeated_prompt_runs_only_its_last_token(chunked: bool) -> None:
    h = Harness(chunked=chunked, budget=32, max_num_seqs=2, prefix_caching=True)
    a = h.add("A", 20, max_tokens=3)  # prompt 1..20, outputs 21, 22, 23
    _finish(h)
    b = h.add("B", 20, max_tokens=3)
    h.run([
        Step({"B": 1}, {"B": [21]}, [], ["B"], []),
        Step({"B": 1}, {"B": [22]}, [], ["B"], []),
        Step({"B": 1}, {"B": [23]}, [], [], ["B"]),
    ])
    assert b.num_cached_tokens == 19 and a.num_cached_tokens == 0
    assert b.slot is None and h.scheduler.num_free_slots == 2


def test_a_shared_prefix_and_the_next_turn_of_a_conversation() -> None:
    h = Harness(chunked=True, budget=32, max_num_seqs=1, prefix_caching=True)
    h.add("A", 10, max_tokens=4)  # prompt 1..10, outputs 11..14: KV held for 1..13 (14 was never fed)
    _finish(h)
    # Next turn: the whole previous exchange plus 3 new tokens (a continuation of the counting).
    turn = h.add("T", 17, max_tokens=1)
    assert h.step().scheduled == {"T": 4}  # 13 tokens cached; 14..17 run
    assert turn.num_cached_tokens == 13
    # Another prompt that shares only its first 5 tokens with what the slot holds now (1..17).
    other = Request("O", [1, 2, 3, 4, 5, 500, 501], SamplingParams(max_tokens=1), 1, frozenset({EOS}))
    h.scheduler.add_request(other)
    assert h.step().scheduled == {"O": 2}
    assert other.num_cached_tokens == 5


def _a_then_unrelated_b(num_slots: int) -> tuple[Harness, Request]:
    """A (tokens 1..12) runs to the end; then B, with nothing in common, is admitted and runs one step."""
    h = Harness(chunked=True, budget=64, max_num_seqs=num_slots, prefix_caching=True)
    h.add("A", 12, max_tokens=2, first_token=1)
    _finish(h)
    b = h.add("B", 12, max_tokens=2, first_token=100)
    h.step()
    return h, b


def test_a_slot_forgets_what_another_prompt_overwrote() -> None:
    h, b = _a_then_unrelated_b(num_slots=1)
    assert b.num_cached_tokens == 0  # B took A's slot, the only one, and overwrites it
    _finish(h)
    again = h.add("A2", 12, max_tokens=2, first_token=1)
    assert h.step().scheduled == {"A2": 12}
    assert again.num_cached_tokens == 0


def test_an_unmatched_prompt_keeps_other_slots_cache() -> None:
    h, b = _a_then_unrelated_b(num_slots=2)
    a_slot = 0  # A ran alone, in the lowest slot
    assert b.slot != a_slot  # B took the slot that held nothing
    _finish(h)
    again = h.add("A2", 12, max_tokens=2, first_token=1)
    h.step()
    assert again.num_cached_tokens == 11 and again.slot == a_slot


def test_no_reuse_when_off_for_prompt_logprobs_or_with_speculation() -> None:
    off = Harness(chunked=True, budget=32, max_num_seqs=1)
    off.add("A", 10, max_tokens=2)
    _finish(off)
    off.add("B", 10, max_tokens=2)
    assert off.step().scheduled == {"B": 10}

    h = Harness(chunked=True, budget=32, max_num_seqs=1, prefix_caching=True)
    h.add("A", 10, max_tokens=2)
    _finish(h)
    h.add("P", 10, max_tokens=2, prompt_logprobs=1)
    assert h.step().scheduled == {"P": 10}  # every prompt position is needed for its logprobs

    config = EngineConfig(max_model_len=64, max_num_seqs=2, enable_prefix_caching=True,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 2}).resolve(None)
    backend = CountingBackend(2, 64, eos=EOS)
    assert not Scheduler(config, backend.capabilities).prefix_caching


def test_common_prefix_len() -> None:
    def lcp(a: list[int], b: list[int]) -> int:
        return _common_prefix_len(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))

    assert lcp([1, 2, 3, 4], [1, 2, 9]) == 2
    assert lcp([1, 2, 3], [1, 2, 3, 4, 5]) == 3
    assert lcp([7], [1]) == 0
    assert lcp([], [1]) == 0
    long = list(range(1000))
    assert lcp(long, [*long[:637], -1]) == 637


def _greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("chunked", [True, False])
def test_reused_prefixes_give_the_same_tokens_on_the_model(chunked: bool) -> None:
    mode = {"enable_chunked_prefill": chunked} | ({"max_num_batched_tokens": 32} if chunked else {})
    cached, plain = shared_core(enable_prefix_caching=True, **mode), shared_core(**mode)
    prompts = tokenize(plain, PROMPTS[:3])
    first = run_to_completion(cached, prompts, _greedy())
    # The same prompts again, and each one's next turn: its prompt, its output and more text.
    more = tokenize(plain, [" And then"])[0]
    turns = [p + o.outputs[0].token_ids + more for p, o in zip(prompts, first, strict=True)]
    queries0 = cached.metrics.prefix_cache_queries.labels(cached.metrics._model)._value.get()
    prompt_tokens0 = cached.metrics.prompt_tokens.labels(cached.metrics._model)._value.get()
    again = run_to_completion(cached, prompts + turns, _greedy())
    reference = run_to_completion(plain, prompts + turns, _greedy())
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in reference]
    assert [o.outputs[0].token_ids for o in again[:3]] == [o.outputs[0].token_ids for o in first]
    hits = cached.metrics.prefix_cache_hits.labels(cached.metrics._model)._value.get()
    queries = cached.metrics.prefix_cache_queries.labels(cached.metrics._model)._value.get() - queries0
    assert queries == sum(len(p) for p in prompts + turns)
    assert hits > 0
    # vllm:prompt_tokens counts each request's whole prompt once, as usage does, however much was cached
    prompt_tokens = cached.metrics.prompt_tokens.labels(cached.metrics._model)._value.get() - prompt_tokens0
    assert prompt_tokens == sum(len(o.prompt_token_ids) for o in again) == sum(len(p) for p in prompts + turns)
