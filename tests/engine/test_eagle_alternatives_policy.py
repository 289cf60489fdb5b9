"""EAGLE's draft alternatives are switched by measured step costs (``EagleProposer.alternatives_policy``): drafting
steps with them against drafting steps without, per batch bucket, as the batch-size policy switches drafting."""

from __future__ import annotations

import pytest

from nxdserve.engine.speculative.eagle import EagleProposer
from nxdserve.engine.speculative.policy import WARMUP_STEPS, BatchSizePolicy
from tests.engine.test_speculative import (
    MAX_LEN,
    MODES,
    copycat_model,
    greedy,
    method_config,
    prompts_of_lengths,
    token_ids,
)
from tests.helpers.engine import make_core, run_to_completion


@pytest.mark.parametrize("alternatives_cost", [3.0, 0.5], ids=["costly", "cheap"])
def test_alternatives_follow_what_steps_with_them_cost(alternatives_cost: float) -> None:
    """One stream (bucket 1) on a clock where a step with alternatives takes ``alternatives_cost`` seconds and one
    without 1: after both arms' warm-up the policy keeps the faster one, re-measuring the other now and then;
    greedy output stays the plain tokens either way."""
    target = copycat_model()
    plain = make_core(model=target, max_model_len=MAX_LEN, **MODES["chunked"])
    prompts = prompts_of_lengths(plain, (6, 7, 8, 9))  # one after another: a single stream
    expected = [token_ids(run_to_completion(plain, [p], greedy(30))) for p in prompts]
    core = make_core(model=target, max_model_len=MAX_LEN, speculative_config=method_config("eagle", target),
                     **MODES["chunked"])
    proposer = core.proposer
    assert isinstance(proposer, EagleProposer) and proposer.num_alternatives > 0
    seconds = 0.0

    def clock() -> float:  # read once a step, when the step just run (shaped by the last decision) is charged
        nonlocal seconds
        seconds += alternatives_cost if proposer._alternatives_now else 1.0
        return seconds

    proposer.alternatives_policy = BatchSizePolicy(clock=clock)
    decisions: list[bool] = []
    ask = proposer.alternatives_policy.should_draft

    def recorded(num_decoding: int) -> bool:
        decisions.append(ask(num_decoding))
        return decisions[-1]

    proposer.alternatives_policy.should_draft = recorded  # type: ignore[method-assign]
    assert [token_ids(run_to_completion(core, [p], greedy(30))) for p in prompts] == expected
    assert len(decisions) >= 2 * WARMUP_STEPS + 8
    warmup, after = decisions[: 2 * WARMUP_STEPS], decisions[2 * WARMUP_STEPS :]
    assert warmup == [True, False] * WARMUP_STEPS  # both arms measured, alternating from "with"
    faster = alternatives_cost < 1.0
    assert sum(d == faster for d in after) >= len(after) - 1  # the loser at most re-measured once
    rates = proposer.describe()["alternatives_policy"]
    assert isinstance(rates, dict) and set(rates["1-1"]) == {"on", "off"}
    assert (rates["1-1"]["on"] > rates["1-1"]["off"]) == faster
