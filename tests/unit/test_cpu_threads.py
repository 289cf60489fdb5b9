"""ThreadGovernor: all threads while they run together, one while another process holds a core."""

from __future__ import annotations

from nxdserve.engine.models.cpu_threads import ThreadGovernor


class Fake:
    def __init__(self) -> None:
        self.now = 0.0
        self.idle = 0
        self.total = 0

    def clock(self) -> float:
        return self.now

    def read(self) -> tuple[int, int]:
        return self.idle, self.total

    def advance(self, seconds: float, idle_cores: float, num_cpus: int = 2) -> None:
        self.now += seconds
        jiffies = int(100 * seconds * num_cpus)
        self.total += jiffies
        self.idle += int(jiffies * idle_cores / num_cpus)


def governor(fake: Fake) -> ThreadGovernor:
    gov = ThreadGovernor(2, clock=fake.clock, idle_reader=fake.read)
    gov._num_cpus = 2
    return gov


def test_drops_to_one_thread_when_steps_mostly_wait_and_returns_when_a_core_is_idle() -> None:
    fake = Fake()
    gov = governor(fake)
    assert gov.step_threads() == 2
    gov.record(0.020, 0.018)  # efficient
    gov.record(0.100, 0.020)  # one slow step alone does not switch
    assert gov.step_threads() == 2
    gov.record(0.020, 0.019)
    for _ in range(gov.bad_steps_to_switch - 1):
        gov.record(0.100, 0.020)
    assert gov.step_threads() == 2  # one short of the run it needs
    gov.record(0.300, 0.020)  # bad_steps_to_switch in a row: contention
    assert gov.step_threads() == 1

    # While busy (no idle core), it stays on one thread.
    for _ in range(20):
        fake.advance(0.5, idle_cores=0.1)
        assert gov.step_threads() == 1
    # Once about a core sits idle over a probe interval, it tries all threads again.
    for _ in range(3):
        fake.advance(0.5, idle_cores=0.95)
        threads = gov.step_threads()
    assert threads == 2
    assert gov.switches == 2


def test_failed_probes_back_off() -> None:
    fake = Fake()
    gov = governor(fake)
    for _ in range(gov.bad_steps_to_switch):
        gov.record(0.1, 0.01)
    assert gov.threads == 1
    waits = []
    for _ in range(4):
        start = fake.now
        while gov.step_threads() == 1:
            fake.advance(0.25, idle_cores=1.0)
        waits.append(fake.now - start)
        for _ in range(gov.bad_steps_to_switch):
            gov.record(0.1, 0.01)  # the probe fails at once
        assert gov.threads == 1
    assert waits[-1] > waits[0]


def test_short_steps_and_single_thread_configs_are_ignored() -> None:
    fake = Fake()
    gov = governor(fake)
    for _ in range(5):
        gov.record(0.001, 0.0)  # too short to judge
    assert gov.threads == 2
    single = ThreadGovernor(1, clock=fake.clock, idle_reader=fake.read)
    assert not single.active and single.step_threads() == 1
