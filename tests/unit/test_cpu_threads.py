"""ThreadGovernor: all threads while they run together, one while another process holds a core.
ThreadBinding: a CPU for each forward thread, only on a thread the engine owns."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdserve.engine.models import cpu_kernels
from nxdserve.engine.models.cpu_threads import ThreadBinding, ThreadGovernor


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


CPUS = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(
    len(CPUS) < 2 or cpu_kernels._library() is None, reason="binding needs two CPUs and the C kernels"
)


def _in_new_thread(fn: Callable[[], Any]) -> Any:
    """Run fn in a fresh thread (its own OpenMP team, and an affinity nobody else shares)."""
    box: list[Any] = []
    worker = threading.Thread(target=lambda: box.append(fn()))
    worker.start()
    worker.join()
    return box[0]


def _tasks_bound_to(cpu: int) -> int:
    """Threads of this process allowed on ``cpu`` alone."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        status = (task / "status").read_text()
        allowed = next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
        count += allowed == str(cpu)
    return count


@needs_two_cpus
def test_an_owned_forward_thread_and_its_team_get_a_cpu_each_and_one_thread_runs_anywhere() -> None:
    def run() -> tuple[set[int], int, set[int]]:
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            binding = ThreadBinding(CPUS[:2])
            binding.enabled = True
            others = _tasks_bound_to(CPUS[1])
            binding.apply(2)
            bound, helpers = os.sched_getaffinity(0), _tasks_bound_to(CPUS[1]) - others
            binding.apply(1)  # the governor's single thread: free again
            return bound, helpers, os.sched_getaffinity(0)
        finally:
            torch.set_num_threads(before)

    bound, helpers, freed = _in_new_thread(run)
    assert bound == {CPUS[0]} and helpers == 1 and freed == set(CPUS[:2])


@needs_two_cpus
def test_binding_stays_off_unless_the_thread_is_owned_or_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(enable: bool, allowed: bool = True) -> set[int]:
        binding = ThreadBinding(CPUS, allowed=allowed)
        binding.enabled = enable
        binding.apply(len(CPUS))
        return os.sched_getaffinity(0)

    assert _in_new_thread(lambda: run(False)) == set(CPUS)
    assert _in_new_thread(lambda: run(True, allowed=False)) == set(CPUS)  # CpuOptions.bind_threads=False
    assert not ThreadBinding(CPUS, allowed=False).allowed and not ThreadBinding([0]).enabled
