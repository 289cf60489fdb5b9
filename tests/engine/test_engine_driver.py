"""EngineCore's one step order: the pipelined drive gives step()'s outputs, and failures are handled once."""

from __future__ import annotations

from typing import Any

import pytest

from nxdserve.engine.core import MAX_CONSECUTIVE_STEP_FAILURES, run_inline
from nxdserve.engine.outputs import RequestOutput
from nxdserve.errors import EngineDeadError
from nxdserve.sampling_params import OutputKind, SamplingParams
from tests.helpers.engine import PROMPTS, run_to_completion, shared_core, tokenize

CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 32}


def _params() -> list[SamplingParams]:
    # Every other request has a stop string: those steps must emit before the next one is launched.
    return [SamplingParams(temperature=0.0, max_tokens=12, stop=[" the"] if i % 2 else None,
                           output_kind=OutputKind.FINAL_ONLY) for i in range(6)]


def test_the_pipelined_order_gives_step_outputs() -> None:
    core = shared_core(**CHUNKED)
    prompts = tokenize(core, PROMPTS[:6])
    expected = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                for o in run_to_completion(core, prompts, _params())]
    ids = []
    for prompt, params in zip(prompts, _params(), strict=True):
        request = core.make_request(prompt, params)
        core.add_request(request)
        ids.append(request.request_id)
    finals: dict[str, RequestOutput] = {}
    step = run_inline(core.launch())
    launched = 0
    while step is not None:  # step n + 1 launched inside complete(n), before n's outputs are made
        outputs, step = run_inline(core.complete(step, overlap=True))
        launched += step is not None
        finals.update({o.request_id: o for o in outputs if o.finished})
    assert launched > 5 and not core.has_unfinished
    got = [(finals[i].outputs[0].token_ids, finals[i].outputs[0].text, finals[i].outputs[0].finish_reason)
           for i in ids]
    assert got == expected
    assert any(reason == "stop" for *_, reason in got)


def test_failed_steps_end_their_requests_and_too_many_in_a_row_end_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core = shared_core(**CHUNKED)
    prompt = tokenize(core, ["Hello"])[0]

    def broken(sched: Any) -> Any:
        raise RuntimeError("device fell over")

    def failing_step() -> RequestOutput:
        core.add_request(core.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=4)))
        outputs = core.step()
        assert len(outputs) == 1 and not core.has_unfinished
        return outputs[0]

    try:
        monkeypatch.setattr(core, "execute", broken)
        out = failing_step()
        assert out.finished and out.outputs[0].finish_reason == "error" and "device fell over" in (out.error or "")
        monkeypatch.undo()  # a good step resets the count
        assert run_to_completion(core, [prompt], SamplingParams(temperature=0.0, max_tokens=2))[0].finished
        assert core.consecutive_failures == 0
        monkeypatch.setattr(core, "execute", broken)
        for _ in range(MAX_CONSECUTIVE_STEP_FAILURES):
            failing_step()
        core.add_request(core.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=4)))
        with pytest.raises(EngineDeadError, match="consecutive steps failed"):
            core.step()
    finally:  # the core is shared with other tests
        monkeypatch.undo()
        core.consecutive_failures = 0
        core.abort(list(core.scheduler.requests))
    assert run_to_completion(core, [prompt], SamplingParams(temperature=0.0, max_tokens=2))[0].finished
