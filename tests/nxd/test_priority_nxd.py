"""Priority scheduling on the nxd backend (the emulator): a preempted request resumes with its prompt and outputs
as one context encoding, and every output is that of the request run alone."""

from __future__ import annotations

from tests.engine.test_priority_scheduling import _params, _run
from tests.helpers.tiny_model import tiny_model_path
from tests.nxd.engines import make_core


def test_preempted_request_resumes_by_context_encoding() -> None:
    core = make_core(str(tiny_model_path("llama")), max_model_len=64, max_num_seqs=2, scheduling_policy="priority")
    jobs = [([1, 450, 7483, 310, 3444], _params(), 5), ([1, 29871, 13, 1576, 7483, 338], _params(), 5)]
    urgent = ([1, 15043, 29892], _params(max_tokens=6), 0)
    alone = [_run(core, [job])[0] for job in (*jobs, urgent)]
    app = core.backend.app  # type: ignore[attr-defined]
    app.calls.clear()
    together = _run(core, jobs, start_after=4, late=urgent)
    assert core.scheduler.num_preemptions_total == 1
    assert together == alone
    assert core.scheduler.num_free_slots == 2
    cte = [c for c in app.calls if c["tag"] == "context_encoding_model"]
    assert len(cte) == 4  # three prompts, and the victim's prompt + outputs once more
