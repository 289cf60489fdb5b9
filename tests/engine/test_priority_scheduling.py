"""--scheduling-policy priority: the waiting queue by (priority, arrival), preemption of the worst running request
for a better waiting one's slot, and resumption by recompute with nothing lost or repeated, in both scheduling
modes and with speculative decoding."""

from __future__ import annotations

from typing import Any

import pytest

from nxdserve.config import EngineConfig
from nxdserve.engine.core import EngineCore
from nxdserve.engine.request import Request, RequestStatus
from nxdserve.errors import InvalidRequestError
from nxdserve.sampling_params import OutputKind, SamplingParams
from nxdserve.scheduler.scheduler import Scheduler
from tests.helpers.counting_backend import CountingBackend
from tests.helpers.eagle import eagle_head
from tests.helpers.engine import make_core
from tests.helpers.tiny_model import tiny_model_path

EOS = 999
MODES = {"chunked": {"enable_chunked_prefill": True}, "prefill-first": {"enable_chunked_prefill": False}}


class Harness:
    """The scheduler and a counting backend (token t is followed by t + 1), driven step by step."""

    def __init__(self, *, chunked: bool, policy: str = "priority", max_num_seqs: int = 2, max_model_len: int = 64,
                 budget: int | None = None, prefix_caching: bool = False) -> None:
        config = EngineConfig(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked, scheduling_policy=policy,  # type: ignore[arg-type]
            enable_prefix_caching=prefix_caching,
        ).resolve(None)
        self.backend = CountingBackend(max_num_seqs, max_model_len, eos=EOS)
        self.backend.bind(max_num_seqs, max_model_len, max_spec_tokens=4)
        self.scheduler = Scheduler(config, self.backend.capabilities)
        self.clock = 0.0
        self.outputs: dict[str, list[int]] = {}

    def add(self, rid: str, prompt_len: int, priority: int, max_tokens: int = 4, first: int = 1) -> Request:
        self.clock += 1.0
        req = Request(rid, [(first + i) % 1000 for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens),
                      max_tokens, frozenset({EOS}), arrival_time=self.clock, priority=priority)
        self.scheduler.add_request(req)
        self.outputs[rid] = []
        return req

    def step(self) -> dict[str, int]:
        """One step; returns what it scheduled (request id -> tokens)."""
        out = self.scheduler.schedule()
        scheduled = {r.request_id: int(n) for r, n in zip(out.requests, out.plan.num_scheduled, strict=True)}
        if not out.is_empty:
            for update in self.scheduler.update_from_output(out, self.backend.execute(out.plan)):
                self.outputs[update.request.request_id] += update.new_token_ids
        return scheduled

    @property
    def waiting(self) -> list[str]:
        return [r.request_id for r in self.scheduler.waiting]

    @property
    def running(self) -> list[str]:
        return sorted(r.request_id for r in self.scheduler.running)

    def drain(self) -> None:
        for _ in range(200):
            if not self.scheduler.has_unfinished:
                return
            self.step()
        raise AssertionError("requests did not finish")


def _alone(prompt_len: int, max_tokens: int, first: int = 1) -> list[int]:
    """What the counting model emits for a request run by itself: the tokens after its prompt's last."""
    last = first + prompt_len - 1
    return [(last + i) % 1000 for i in range(1, max_tokens + 1)]


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "prefill-first"])
def test_admission_by_priority_then_arrival(chunked: bool) -> None:
    h = Harness(chunked=chunked, max_num_seqs=2)
    for rid, priority in (("late", 5), ("urgent", -1), ("mid-a", 1), ("mid-b", 1)):
        h.add(rid, 4, priority)
    assert h.waiting == ["urgent", "mid-a", "mid-b", "late"]
    assert set(h.step()) == {"urgent", "mid-a"}
    assert h.waiting == ["mid-b", "late"]  # equal priorities: arrival order; nothing running is worse
    h.drain()
    assert all(out == _alone(4, 4) for out in h.outputs.values())


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "prefill-first"])
def test_fcfs_ignores_priority_order(chunked: bool) -> None:
    h = Harness(chunked=chunked, policy="fcfs", max_num_seqs=1)
    h.add("a", 4, 0)
    h.step()
    h.add("b", 4, 0)
    h.step()
    assert h.running == ["a"] and h.waiting == ["b"] and h.scheduler.num_preemptions_total == 0


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "prefill-first"])
def test_preemption_victim_is_worst_running_and_output_continues(chunked: bool) -> None:
    h = Harness(chunked=chunked, max_num_seqs=2)
    h.add("a", 5, 3, max_tokens=8, first=10)
    h.add("b", 5, 3, max_tokens=8, first=40)  # same priority, later: the worse of the two
    h.step()
    h.step()
    h.step()
    assert h.outputs["b"] and h.running == ["a", "b"]
    h.add("c", 3, 7, first=70)  # worse than both: waits, preempts nothing
    h.step()
    assert h.waiting == ["c"] and h.scheduler.num_preemptions_total == 0
    h.add("urgent", 3, 0, first=100)
    scheduled = h.step()
    assert "urgent" in scheduled and "b" not in scheduled
    assert h.running == ["a", "urgent"] and h.waiting == ["b", "c"]  # b back by its key, ahead of c
    b = h.scheduler.requests["b"]
    assert b.num_preemptions == 1 and b.slot is None and b.status is RequestStatus.WAITING
    h.drain()
    assert h.outputs == {"a": _alone(5, 8, 10), "b": _alone(5, 8, 40), "c": _alone(3, 4, 70),
                         "urgent": _alone(3, 4, 100)}
    # A resumed request recomputes its prompt and its outputs: the counting backend checked that every span
    # ran over KV of the request's own tokens.
    resumed = [p for p in h.backend.plans if any(new.request_id == "b" and new.resumed for new in p.new_requests)]
    assert len(resumed) == 1
    assert resumed[0].new_requests[0].output_token_ids == _alone(5, 8, 40)[: len(resumed[0].new_requests[0]
                                                                                  .output_token_ids)]
    assert h.scheduler.num_free_slots == 2


def test_victim_refunds_its_tokens_in_the_step() -> None:
    """Chunked: a victim scheduled earlier in the same step gives its tokens back to the budget."""
    h = Harness(chunked=True, max_num_seqs=1, budget=8)
    h.add("low", 4, 5, max_tokens=6)
    h.step()
    h.add("high", 8, 0, first=200)
    scheduled = h.step()
    assert scheduled == {"high": 8}  # low's decode token went back: high's prompt runs whole
    h.drain()
    assert h.outputs == {"low": _alone(4, 6), "high": _alone(8, 4, 200)}


def test_preempted_request_reuses_its_line_with_prefix_caching() -> None:
    h = Harness(chunked=True, max_num_seqs=2, prefix_caching=True)
    h.add("a", 6, 1, max_tokens=6, first=10)
    h.add("b", 6, 2, max_tokens=6, first=40)
    h.step()
    h.step()
    h.add("urgent", 3, 0, max_tokens=2, first=100)
    h.step()
    assert h.waiting == ["b"]
    h.drain()
    assert h.outputs["b"] == _alone(6, 6, 40)
    resumed = next(new for p in h.backend.plans for new in p.new_requests if new.request_id == "b" and new.resumed)
    assert resumed.output_token_ids  # it had generated tokens when preempted
    assert h.scheduler.num_free_slots == 2


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "prefill-first"])
def test_abort_of_preempted_request(chunked: bool) -> None:
    h = Harness(chunked=chunked, max_num_seqs=1)
    h.add("low", 4, 5, max_tokens=10)
    h.step()
    h.step()
    h.add("high", 4, 0, first=50)
    h.step()
    assert h.waiting == ["low"]
    h.scheduler.finish_requests(["low"], RequestStatus.FINISHED_ABORTED)
    assert not h.waiting and "low" not in h.scheduler.requests
    h.step()
    assert h.backend.plans[-1].discarded_request_ids == ["low"]  # the backend drops what it kept for the resume
    h.drain()
    assert h.scheduler.num_free_slots == 1 and h.outputs["high"] == _alone(4, 4, 50)


def test_priority_needs_priority_policy() -> None:
    core = make_core(model=str(tiny_model_path("llama")), max_model_len=64, max_num_seqs=2)
    with pytest.raises(InvalidRequestError) as info:
        core.make_request([1, 2, 3], SamplingParams(max_tokens=2), priority=1)
    assert info.value.param == "priority"
    assert core.make_request([1, 2, 3], SamplingParams(max_tokens=2), priority=0).priority == 0


# -- end to end on a tiny model: outputs under preemption are those of each request run alone --------------
SPECS: dict[str, Any] = {
    "none": None,
    "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4, "num_speculative_tokens": 3,
              "disable_by_batch_size": 1024},
    "eagle": {"method": "eagle", "num_speculative_tokens": 3, "disable_by_batch_size": 1024},
}


def _core(mode: str, spec: str) -> EngineCore:
    target = str(tiny_model_path("llama"))
    config = SPECS[spec]
    if spec == "eagle":
        config = {**config, "model": eagle_head(target, "identity")}
    return make_core(model=target, max_model_len=64, max_num_seqs=2, scheduling_policy="priority",
                     speculative_config=config, num_threads=1, **MODES[mode])


def _params(seed: int | None = None, max_tokens: int = 10) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                              output_kind=OutputKind.FINAL_ONLY)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=OutputKind.FINAL_ONLY)


def _run(core: EngineCore, jobs: list[tuple[list[int], SamplingParams, int]], start_after: int = 0,
         late: tuple[list[int], SamplingParams, int] | None = None) -> list[list[int]]:
    """Submit ``jobs``, step ``start_after`` times, submit ``late``, step to the end; outputs in order."""
    ids = []
    for prompt, params, priority in jobs:
        request = core.make_request(prompt, SamplingParams(**vars(params)), priority=priority)
        core.add_request(request)
        ids.append(request.request_id)
    finals: dict[str, list[int]] = {}
    for i in range(500):
        if i == start_after and late is not None:
            request = core.make_request(late[0], SamplingParams(**vars(late[1])), priority=late[2])
            core.add_request(request)
            ids.append(request.request_id)
        for out in core.step():
            if out.finished:
                finals[out.request_id] = list(out.outputs[0].token_ids)
        if not core.has_unfinished and (late is None or i >= start_after):
            break
    return [finals[i] for i in ids]


@pytest.mark.parametrize(("mode", "spec"), [("chunked", "none"), ("prefill-first", "none"), ("chunked", "eagle"),
                                            ("prefill-first", "ngram")])
def test_outputs_under_preemption_match_running_alone(mode: str, spec: str) -> None:
    core = _core(mode, spec)
    # Seeded sampling continues its generator across a preemption; with speculation the victim's drafts (and
    # so the draws rejection sampling makes) change at the resume, so only greedy outputs are comparable there.
    seeded = _params(seed=7) if spec == "none" else _params()
    jobs = [([1, 450, 7483, 310, 3444], _params(), 5), ([1, 29871, 13, 1576, 7483, 338], seeded, 5)]
    urgent = ([1, 15043, 29892], _params(max_tokens=6), 0)
    alone = [_run(core, [job])[0] for job in (*jobs, urgent)]
    before = core.scheduler.num_preemptions_total
    together = _run(core, jobs, start_after=4, late=urgent)
    assert core.scheduler.num_preemptions_total == before + 1  # the second request, the later of the two
    assert together == alone
    assert core.scheduler.num_free_slots == 2 and not core.scheduler.requests
    assert not core.backend.batch.suspended_generators  # type: ignore[union-attr]

