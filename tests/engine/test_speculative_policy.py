"""The batch-size rule: drafting stays on where it measured faster and turns off where it did not."""

from __future__ import annotations

import numpy as np

from nxdserve.engine.speculative.policy import (
    EXPLORE_EVERY,
    EXPLORE_MAX,
    LARGE_BATCH,
    LARGE_BATCH_MARGIN,
    WARMUP_STEPS,
    BatchSizePolicy,
    batch_bucket,
    explore_interval,
)
from nxdserve.engine.step import StepPlan, StepResult


def decode_step(batch: int, drafts: int, tokens_per_row: float, seconds: float) -> tuple[StepPlan, StepResult]:
    plan = StepPlan(
        slots=np.arange(batch), start_pos=np.full(batch, 10), num_scheduled=np.full(batch, 1 + drafts),
        num_drafts=np.full(batch, drafts), sample=np.ones(batch, dtype=bool),
    )
    sampled = np.full(batch, int(tokens_per_row))
    result = StepResult(np.zeros((batch, 1 + drafts), dtype=np.int64), sampled,
                        timings={"prepare": 0.0, "forward": seconds, "sample": 0.0})
    return plan, result


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def new_policy() -> BatchSizePolicy:
    return BatchSizePolicy(clock=Clock())


def run_step(policy: BatchSizePolicy, batch: int, drafts: int, tokens: float, seconds: float) -> None:
    """One step of ``seconds`` on the policy's clock, then its result."""
    assert isinstance(policy.clock, Clock)
    policy.clock.now += seconds
    policy.observe(*decode_step(batch, drafts, tokens, seconds))


def simulate(policy: BatchSizePolicy, batch: int, steps: int, on: tuple[float, float],
             off: tuple[float, float]) -> list[bool]:
    """Drive the policy: each decision shapes the next step, which yields (tokens per row, seconds)."""
    run_step(policy, batch, 0, 1, 0.01)  # the clock's first reading
    decisions = []
    for _ in range(steps):
        draft = policy.should_draft(batch)
        decisions.append(draft)
        tokens, seconds = on if draft else off
        run_step(policy, batch, 3 if draft else 0, tokens, seconds)
    return decisions


def test_buckets_are_powers_of_two() -> None:
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]


def test_fixed_threshold_is_vllms_rule() -> None:
    policy = BatchSizePolicy(disable_by_batch_size=8)
    assert policy.should_draft(1) and policy.should_draft(8)
    assert not policy.should_draft(9) and not policy.should_draft(0)


def test_keeps_drafting_where_it_pays_and_stops_where_it_does_not() -> None:
    policy = new_policy()
    # Small batch: 2 tokens per row in 1.1x the time of a plain step -> drafting wins.
    small = simulate(policy, 1, 200, on=(2, 0.011), off=(1, 0.010))
    # Large batch: 1.5 tokens per row in 2.5x the time -> plain decoding wins.
    large = simulate(policy, 32, 200, on=(1.5, 0.25), off=(1, 0.10))
    warm = 2 * WARMUP_STEPS
    assert sum(small[warm:]) >= (200 - warm) * (1 - 1.5 / EXPLORE_EVERY)
    assert sum(large[warm:]) <= (200 - warm) * 1.5 / EXPLORE_EVERY
    assert any(large[warm:]), "the losing arm is still re-measured now and then"
    rates = policy.describe()
    assert rates["1-1"]["on"] > rates["1-1"]["off"] and rates["17-32"]["on"] < rates["17-32"]["off"]


def test_a_near_tie_drafts_at_small_batches_but_not_at_large_ones() -> None:
    """Drafting 3% ahead: kept at one request (any gain counts where steps are bound by weight reads),
    not above LARGE_BATCH requests, where it must win by LARGE_BATCH_MARGIN."""
    ahead = 1.0 + LARGE_BATCH_MARGIN * 0.6
    warm = 2 * WARMUP_STEPS
    small = simulate(new_policy(), 1, 100, on=(1, 0.010 / ahead), off=(1, 0.010))
    large = simulate(new_policy(), 2 * LARGE_BATCH, 100, on=(1, 0.010 / ahead), off=(1, 0.010))
    assert sum(small[warm:]) >= (100 - warm) * (1 - 1.5 / EXPLORE_EVERY)
    assert sum(large[warm:]) <= (100 - warm) * 1.5 / EXPLORE_EVERY
    # A clear win above LARGE_BATCH still drafts.
    clear = simulate(new_policy(), 2 * LARGE_BATCH, 100, on=(1, 0.010 / 1.2), off=(1, 0.010))
    assert sum(clear[warm:]) >= (100 - warm) * (1 - 1.5 / EXPLORE_EVERY)


def test_follows_a_change_in_acceptance() -> None:
    policy = new_policy()
    simulate(policy, 4, 100, on=(3, 0.012), off=(1, 0.010))
    later = simulate(policy, 4, 400, on=(1, 0.012), off=(1, 0.010))  # drafts stop being accepted
    assert sum(later[-100:]) <= 100 // EXPLORE_EVERY + 1, "should have turned off, exploring rarely"


def test_steps_that_are_not_plain_decode_are_not_measured() -> None:
    policy = new_policy()
    run_step(policy, 2, 0, 1, 0.01)
    assert policy.should_draft(2)
    plan, result = decode_step(2, 3, 4, 0.01)
    plan.sample[0] = False  # a prefill chunk in the step
    policy.observe(plan, result)
    assert policy.describe() == {}


def test_one_slow_outlier_step_does_not_flip_the_decision() -> None:
    policy = new_policy()
    simulate(policy, 1, 60, on=(2, 0.011), off=(1, 0.010))
    assert policy.should_draft(1)
    run_step(policy, 1, 3, 2, 0.5)  # a 45x slower step
    assert sum(simulate(policy, 1, 10, on=(2, 0.011), off=(1, 0.010))) >= 9


def test_drafting_that_pays_on_average_stays_on_when_most_steps_accept_nothing() -> None:
    """First-draft acceptance 40%: 60% of drafting steps yield 1 token (and cost 1.2x a plain step),
    40% yield 3. The mean rate is 1.8 / 1.2 = 1.5x plain, though the median step is slower than plain
    (a median of per-step rates drafts only on its 1-in-16 explorations). A run of unlucky windows can
    still turn drafting off for a while, so this counts over a few seeds."""
    on = 0
    for seed in range(4):
        policy = new_policy()
        rng = np.random.default_rng(seed)
        run_step(policy, 1, 0, 1, 0.01)
        for step in range(300):
            draft = policy.should_draft(1)
            on += draft and step >= 100
            tokens = (3 if rng.random() < 0.4 else 1) if draft else 1
            run_step(policy, 1, 2 if draft else 0, tokens, 0.012 if draft else 0.010)
    assert on >= 0.75 * 4 * 200


def test_a_far_behind_arm_is_re_measured_rarely() -> None:
    """Re-measuring costs the winner/loser ratio - 1 of a step each time: every EXPLORE_EVERY steps while
    the arms are close, rarely enough to cost about EXPLORE_COST when the loser is far behind."""
    assert explore_interval(100.0, 95.0) == EXPLORE_EVERY
    assert explore_interval(160.0, 100.0) == 60
    assert explore_interval(100.0, 1.0) == EXPLORE_MAX
    warm = 2 * WARMUP_STEPS
    # Drafting at batch 32 takes 1.6x a plain step for 1.0x the tokens: on for 1 step in 60, not 1 in 16.
    decisions = simulate(new_policy(), 32, 600, on=(1, 0.016), off=(1, 0.010))
    assert sum(decisions[warm:]) == (600 - warm) // 60
    # Close arms keep the old rate.
    close = simulate(new_policy(), 32, 320, on=(1, 0.0101), off=(1, 0.010))
    assert sum(close[warm:]) == (320 - warm) // EXPLORE_EVERY
