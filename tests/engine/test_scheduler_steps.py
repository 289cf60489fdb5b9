"""Scheduler step tables (vllm-spyre style): drive the scheduler step by step and check each step."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from nxdserve.config import EngineConfig
from nxdserve.engine.request import Request, RequestStatus
from nxdserve.sampling_params import SamplingParams
from nxdserve.scheduler.scheduler import Scheduler
from tests.helpers.counting_backend import CountingBackend

EOS = 999


@dataclass
class Step:
    scheduled: dict[str, int]  # request id -> tokens run this step
    outputs: dict[str, list[int]]  # request id -> tokens emitted this step
    waiting: list[str]
    running: list[str]
    finished: list[str]


class Harness:
    def __init__(self, *, chunked: bool, max_model_len: int = 64, max_num_seqs: int = 4,
                 budget: int | None = None, threshold: int = 0, partial: int = 1, consecutive: int = 1,
                 overflow: int | None = None, prefix_caching: bool = False, **caps: object) -> None:
        self.config = EngineConfig(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold,
            max_num_partial_prefills=partial, max_consecutive_prefill_steps=consecutive,
            whole_prompt_overflow=overflow, enable_prefix_caching=prefix_caching,
        ).resolve(None)
        self.backend = CountingBackend(max_num_seqs, max_model_len, eos=EOS, **caps)
        self.batch = self.backend.bind(max_num_seqs, max_model_len, max_spec_tokens=8)
        self.scheduler = Scheduler(self.config, self.backend.capabilities)
        self.requests: dict[str, Request] = {}

    def add(self, rid: str, prompt_len: int, max_tokens: int | None = None, first_token: int = 1,
            **params: object) -> Request:
        prompt = [(first_token + i) % 1000 for i in range(prompt_len)]
        sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
        limit = max_tokens if max_tokens is not None else self.config.max_model_len - prompt_len  # type: ignore[operator]
        req = Request(rid, prompt, sp, limit, frozenset({EOS}))
        self.requests[rid] = req
        self.scheduler.add_request(req)
        return req

    def step(self) -> Step:
        out = self.scheduler.schedule()
        scheduled = {r.request_id: int(n) for r, n in zip(out.requests, out.plan.num_scheduled, strict=True)}
        result = self.backend.execute(out.plan)
        updates = self.scheduler.update_from_output(out, result)
        return Step(
            scheduled=scheduled,
            outputs={u.request.request_id: u.new_token_ids for u in updates if u.new_token_ids},
            waiting=[r.request_id for r in self.scheduler.waiting],
            running=[r.request_id for r in self.scheduler.running],
            finished=[u.request.request_id for u in updates if u.finished],
        )

    def run(self, table: list[Step]) -> None:
        for i, expected in enumerate(table, start=1):
            got = self.step()
            assert got == expected, f"step {i}: expected {expected}, got {got}"


def test_chunked_splits_prompt_and_mixes_decode() -> None:
    h = Harness(chunked=True, budget=8, max_num_seqs=2)
    h.add("A", 10, max_tokens=3, first_token=1)  # prompt 1..10, outputs 11, 12, 13
    h.add("B", 3, max_tokens=3, first_token=1)  # prompt 1..3, outputs 4, 5, 6
    h.run([
        Step({"A": 8}, {}, ["B"], ["A"], []),
        Step({"A": 2, "B": 3}, {"A": [11], "B": [4]}, [], ["A", "B"], []),
        Step({"A": 1, "B": 1}, {"A": [12], "B": [5]}, [], ["A", "B"], []),
        Step({"A": 1, "B": 1}, {"A": [13], "B": [6]}, [], [], ["A", "B"]),
    ])
    assert h.scheduler.num_free_slots == 2


def test_partial_prefill_cap_is_enforced_and_short_prompts_go_ahead() -> None:
    h = Harness(chunked=True, budget=12, threshold=4, partial=1)
    h.add("L1", 10, max_tokens=1)
    h.add("L2", 10, max_tokens=1)
    h.add("S", 2, max_tokens=1)
    # L1 takes a 4-token chunk and becomes the one partial prefill; L2 would be a second partial
    # prefill, so it waits, but S completes its prompt within this step and is admitted.
    h.run([
        Step({"L1": 4, "S": 2}, {"S": [3]}, ["L2"], ["L1"], ["S"]),
        Step({"L1": 4}, {}, ["L2"], ["L1"], []),
        # L1 finishes its prompt this step, so it no longer counts and L2 may start its first chunk.
        Step({"L1": 2, "L2": 4}, {"L1": [11]}, [], ["L2"], ["L1"]),
    ])


def test_short_prompts_run_whole_past_the_budget_and_long_ones_are_still_split() -> None:
    h = Harness(chunked=True, budget=8, overflow=4, max_num_seqs=4)
    h.add("A", 5, max_tokens=2)
    h.add("B", 6, max_tokens=2)  # 3 tokens of budget left: runs whole, 11 tokens in all (<= 8 + 4)
    h.add("C", 3, max_tokens=2)  # 1 token of room left: waits rather than split
    h.add("L", 10, max_tokens=1)  # longer than a step: split as always
    h.run([
        Step({"A": 5, "B": 6}, {"A": [6], "B": [7]}, ["C", "L"], ["A", "B"], []),
        # Decodes take 2 of 8; C (3) fits the 6 left; L gets the remaining 3 as a chunk.
        Step({"A": 1, "B": 1, "C": 3, "L": 3}, {"A": [7], "B": [8], "C": [4]}, [], ["C", "L"], ["A", "B"]),
        Step({"C": 1, "L": 7}, {"C": [5], "L": [11]}, [], [], ["C", "L"]),
    ])
    # Without the overflow B is split at the budget.
    plain = Harness(chunked=True, budget=8, overflow=0, max_num_seqs=4)
    plain.add("A", 5, max_tokens=2)
    plain.add("B", 6, max_tokens=2)
    assert plain.step().scheduled == {"A": 5, "B": 3}


def test_whole_prompt_overflow_defaults_on_only_with_the_cpu_default_budget() -> None:
    from nxdserve.config import DEFAULT_CPU_CHUNKED_BATCHED_TOKENS as CPU

    on_cpu = {"chunked_token_budget": CPU, "on_cpu": True}  # as the loader resolves for the torch backend on a CPU
    assert EngineConfig().resolve(None, **on_cpu).whole_prompt_overflow == CPU // 2
    assert EngineConfig(max_num_batched_tokens=CPU).resolve(None, **on_cpu).whole_prompt_overflow == 0
    assert EngineConfig().resolve(None).whole_prompt_overflow == 0  # an accelerator's default budget
    assert EngineConfig().resolve(None, chunked_token_budget=CPU).whole_prompt_overflow == 0  # not a CPU
    assert EngineConfig(enable_chunked_prefill=False).resolve(None, **on_cpu).whole_prompt_overflow == 0
    assert EngineConfig(whole_prompt_overflow=16).resolve(None).whole_prompt_overflow == 16


def test_partial_prefill_cap_two_allows_two_chunked_prompts() -> None:
    h = Harness(chunked=True, budget=12, threshold=4, partial=2)
    h.add("L1", 10, max_tokens=1)
    h.add("L2", 10, max_tokens=1)
    step = h.step()
    assert step.scheduled == {"L1": 4, "L2": 4}
    assert sum(1 for r in h.scheduler.running if r.is_prefilling) == 2


def test_prefill_first_never_splits_and_interleaves_under_load() -> None:
    h = Harness(chunked=False, max_model_len=64, max_num_seqs=4, consecutive=1)
    h.add("A", 5, max_tokens=4)
    h.add("B", 3, max_tokens=4, first_token=20)
    h.run([Step({"A": 5, "B": 3}, {"A": [6], "B": [23]}, [], ["A", "B"], [])])
    h.add("C", 4, max_tokens=4, first_token=40)
    h.add("D", 4, max_tokens=4, first_token=60)
    h.run([
        # One prefill step while decodes wait, then a decode step, then the next prefill...
        Step({"C": 4, "D": 4}, {"C": [44], "D": [64]}, [], ["A", "B", "C", "D"], []),
        Step({"A": 1, "B": 1, "C": 1, "D": 1}, {"A": [7], "B": [24], "C": [45], "D": [65]}, [],
             ["A", "B", "C", "D"], []),
    ])


def test_prefill_first_anti_starvation_with_one_prompt_per_step() -> None:
    h = Harness(chunked=False, max_num_seqs=4, consecutive=1, max_prefills_per_step=1)
    for rid, first in (("A", 1), ("B", 20), ("C", 40)):
        h.add(rid, 3, max_tokens=5, first_token=first)
    kinds = []
    for _ in range(5):
        step = h.step()
        prefill = any(h.requests[r].num_computed_tokens <= h.requests[r].num_prompt_tokens for r in step.scheduled)
        kinds.append("P" if prefill and len(step.scheduled) == 1 and step.scheduled[next(iter(step.scheduled))] == 3
                     else "D")
    # Step 1 has no decode waiting, so it does not count; from then on prefill and decode alternate.
    assert kinds == ["P", "P", "D", "P", "D"]


def test_prefill_first_budget_is_raised_to_max_model_len() -> None:
    h = Harness(chunked=False, max_model_len=64, budget=16)
    assert h.config.max_num_batched_tokens == 64
    h.add("A", 40, max_tokens=2)
    assert h.step().scheduled == {"A": 40}


def test_full_slot_table_waits_then_takes_freed_slot() -> None:
    h = Harness(chunked=True, max_num_seqs=2, budget=32)
    h.add("A", 3, max_tokens=1)
    h.add("B", 3, max_tokens=3, first_token=10)
    h.add("C", 3, max_tokens=1, first_token=30)
    h.run([
        Step({"A": 3, "B": 3}, {"A": [4], "B": [13]}, ["C"], ["B"], ["A"]),
        Step({"B": 1, "C": 3}, {"B": [14], "C": [33]}, [], ["B"], ["C"]),
    ])
    # C got slot 0, the one A freed (lowest free slot first).
    assert h.backend.plans[1].slots.tolist() == [0, 1]


def test_finishes_exactly_at_max_model_len() -> None:
    h = Harness(chunked=True, max_model_len=16, budget=16)
    req = h.add("A", 10)  # max_tokens omitted: up to max_model_len
    for _ in range(7):
        h.step()
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.num_tokens == 16 and req.num_output_tokens == 6
    assert max(int((p.start_pos + p.num_scheduled).max()) for p in h.backend.plans if p.num_rows) == 15


@pytest.mark.parametrize("chunked", [True, False])
def test_drafts_are_clamped_at_the_context_limit(chunked: bool) -> None:
    h = Harness(chunked=chunked, max_model_len=16, budget=16)
    req = h.add("A", 12, first_token=1)  # prompt 1..12
    h.step()  # prefill -> 13
    assert req.output_token_ids == [13] and req.num_computed_tokens == 12
    req.spec_token_ids = [14, 15, 16, 17]  # all correct, but only 2 fit below max_model_len - 1
    step = h.step()
    assert step.scheduled == {"A": 3}
    assert step.outputs == {"A": [14, 15, 16]}
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and req.num_tokens == 16


def test_rejected_drafts_roll_back_computed_tokens() -> None:
    h = Harness(chunked=True, max_model_len=64, budget=16)
    req = h.add("A", 4, max_tokens=10)
    h.step()
    req.spec_token_ids = [6, 99, 8]  # first right, second wrong
    step = h.step()
    assert step.outputs == {"A": [6, 7]}  # accepted draft + the target's correction
    assert req.num_computed_tokens == req.num_tokens - 1


def test_drafts_count_against_the_budget() -> None:
    h = Harness(chunked=True, max_model_len=64, budget=4, max_num_seqs=2)
    a = h.add("A", 2, max_tokens=10)
    b = h.add("B", 2, max_tokens=10, first_token=50)
    h.step()
    a.spec_token_ids = [4, 5, 6]
    b.spec_token_ids = [53, 54, 55]
    step = h.step()
    assert step.scheduled == {"A": 4}  # A takes the whole budget, B waits for the next step
    assert step.outputs == {"A": [4, 5, 6, 7]}


def test_abort_frees_slot_and_is_idempotent() -> None:
    h = Harness(chunked=True, max_num_seqs=1, budget=16)
    h.add("A", 3, max_tokens=50)
    h.add("B", 3, max_tokens=1)
    h.step()
    assert h.scheduler.num_free_slots == 0
    assert [r.request_id for r in h.scheduler.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)] == ["A"]
    assert h.scheduler.finish_requests(["A", "nope"], RequestStatus.FINISHED_ABORTED) == []
    assert h.scheduler.num_free_slots == 1
    assert h.batch.request_ids[0] == "A"  # the backend's batch changes only with the next plan
    assert h.step().finished == ["B"]
    plan = h.backend.plans[-1]
    assert plan.freed_slots == [0] and [(n.slot, n.request_id) for n in plan.new_requests] == [(0, "B")]
    assert h.batch.request_ids[0] == "B" and h.batch.num_prompt_tokens[0] == 3


def test_a_free_without_a_step_waits_for_the_next_plan() -> None:
    h = Harness(chunked=True, max_num_seqs=2, budget=16)
    h.add("A", 3, max_tokens=50)
    h.step()
    h.scheduler.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
    assert h.scheduler.schedule().is_empty  # nothing runs, so this plan is never sent: it carries no diffs
    h.add("B", 4, max_tokens=1)
    assert h.step().finished == ["B"]
    plan = h.backend.plans[-1]
    assert plan.freed_slots == [0] and plan.new_slots == [0]
    assert h.batch.active.tolist() == [True, False] and h.batch.request_ids[0] == "B"


def test_abort_of_waiting_request() -> None:
    h = Harness(chunked=True, max_num_seqs=1, budget=16)
    h.add("A", 3, max_tokens=5)
    h.add("B", 3, max_tokens=5)
    h.step()
    h.scheduler.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)
    assert not h.scheduler.waiting and "B" not in h.scheduler.requests


def test_stop_token_and_eos_with_min_tokens() -> None:
    h = Harness(chunked=True, budget=16)
    a = h.add("A", 3, max_tokens=10, stop_token_ids=[6])  # 4, 5, 6 -> stops on 6
    b = h.add("B", 3, max_tokens=10, first_token=995, min_tokens=3)  # 998, 999(eos) ignored, 0, ...
    c = h.add("C", 3, max_tokens=10, first_token=995, ignore_eos=True)
    for _ in range(5):
        h.step()
    assert a.output_token_ids == [4, 5, 6] and a.stop_reason == 6 and a.status == RequestStatus.FINISHED_STOPPED
    assert b.output_token_ids[:3] == [998, 999, 0] and b.num_output_tokens == 5  # eos only masked until 3
    assert 999 in c.output_token_ids and c.status == RequestStatus.RUNNING


def test_eos_stops_without_stop_reason() -> None:
    h = Harness(chunked=False)
    a = h.add("A", 3, max_tokens=10, first_token=995)  # emits 998 then 999 (eos)
    h.step()
    h.step()
    assert a.output_token_ids == [998, 999] and a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason is None
