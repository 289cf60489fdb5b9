"""ThreadGovernor: one or all intra-op threads per step, on a CPU that other processes may share.

OpenMP splits every op of a forward statically over its threads and waits for all of them at the end
(about 200 such regions per decode step). When another process holds a core, the thread that lost its
core finishes its share a scheduler time slice later, in every region: measured on a 2-core VM shared
with other jobs, 2-thread decode steps then took 5-30x longer than 1-thread ones (20 ms -> 0.1-1 s),
while on the idle machine 2 threads were 1.2-1.4x faster. No fixed thread count is right for both, so
the governor watches each step:

- with all threads, the calling thread does its share and then sleeps (passive wait) until the others
  finish; if it spent most of a step waiting (its CPU time < ``min_efficiency`` of the step's wall
  time) in ``bad_steps_to_switch`` (4) steps running, another process has a core: drop to one thread;
- with one thread, look at the machine's idle time (``/proc/stat``) every ``probe_interval`` seconds
  (after a back-off that doubles, up to ``max_backoff``, while probes keep failing): when about a core
  has been idle, go back to all threads.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


def _cpu_idle_jiffies() -> tuple[int, int] | None:
    """(idle + iowait, total) jiffies of all CPUs since boot; None where /proc/stat is unavailable."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 5 or fields[0] != b"cpu":
        return None
    values = [int(v) for v in fields[1:9]]
    return values[3] + (values[4] if len(values) > 4 else 0), sum(values)


class ThreadGovernor:
    def __init__(
        self,
        max_threads: int,
        *,
        min_efficiency: float = 0.6,
        bad_steps_to_switch: int = 4,
        min_wall_s: float = 0.004,
        probe_interval_s: float = 0.5,
        idle_cores_to_probe: float = 0.6,
        max_backoff_s: float = 16.0,
        clock: Callable[[], float] = time.monotonic,
        idle_reader: Callable[[], tuple[int, int] | None] = _cpu_idle_jiffies,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self.min_efficiency = min_efficiency
        # Real contention (another job on a core) makes every step 5-30x slower, so four in a row come at
        # once; two were also met by the load generator's bursts on the same two cores, and one thread then
        # cost a benchmark ~10% of its throughput.
        self.bad_steps_to_switch = bad_steps_to_switch
        self.min_wall_s = min_wall_s
        self.probe_interval_s = probe_interval_s
        self.idle_cores_to_probe = idle_cores_to_probe
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._read_idle = idle_reader
        self._num_cpus = os.cpu_count() or 1
        self._bad_steps = 0
        self._backoff_s = probe_interval_s
        self._mode_since = clock()
        self._idle_mark: tuple[int, int] | None = None
        self._idle_mark_time = 0.0
        self.switches = 0  # for logs and tests

    @property
    def active(self) -> bool:
        return self.max_threads > 1

    def step_threads(self) -> int:
        """The thread count for the next step."""
        if self.threads == 1 and self.active:
            now = self._clock()
            if now - self._mode_since >= self._backoff_s and now - self._idle_mark_time >= self.probe_interval_s:
                idle = self._read_idle()
                mark, self._idle_mark, self._idle_mark_time = self._idle_mark, idle, now
                if idle is not None and mark is not None and idle[1] > mark[1]:
                    idle_cores = self._num_cpus * (idle[0] - mark[0]) / (idle[1] - mark[1])
                    if idle_cores >= self.idle_cores_to_probe:
                        self._switch(self.max_threads, now)
        return self.threads

    def record(self, wall_s: float, thread_cpu_s: float) -> None:
        """After a step run with ``step_threads()`` threads: its wall time and the calling thread's CPU time."""
        if self.threads == 1 or wall_s < self.min_wall_s:
            return
        if thread_cpu_s < self.min_efficiency * wall_s:
            self._bad_steps += 1
            if self._bad_steps >= self.bad_steps_to_switch:
                now = self._clock()
                # A probe that failed quickly: wait longer before the next; a long good run resets it.
                quick = now - self._mode_since < 4 * self.max_backoff_s
                self._backoff_s = min(2 * self._backoff_s, self.max_backoff_s) if quick else self.probe_interval_s
                self._switch(1, now)
        else:
            self._bad_steps = 0

    def _switch(self, threads: int, now: float) -> None:
        logger.info(
            "thread governor: %d -> %d intra-op threads (%s)", self.threads, threads,
            "another process holds a core" if threads == 1 else "a core is idle again",
        )  # fmt: skip
        self.threads = threads
        self._mode_since = now
        self._bad_steps = 0
        self._idle_mark = None
        self._idle_mark_time = 0.0
        self.switches += 1


def _allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return []


class ThreadBinding:
    """One CPU for each intra-op thread of the forward, while a step runs on as many threads as the process
    has CPUs; a single thread (the governor's choice when another process holds a core) runs anywhere. Off
    until ``enabled`` is set by whoever owns the forward's thread (the async engine's model thread): a caller
    running the engine on its own thread keeps that thread unbound, and the threads it starts later too.

    Why: a process that takes part of a core (a load generator on the same machine, an agent) preempts one
    forward thread now and then; unbound, the scheduler also moves the forward threads between the cores,
    and a moved thread runs on with the other core's cold L1/L2 (its panels of the weights), the likely
    reason for what was measured: served on a 2-core VM with a process burning 1 ms of every 5, three
    interleaved rounds, workload a 594-650 vs 530-605 tok/s and the single stream 48-55 vs 41-45 tok/s;
    with nothing else running, no difference beyond the rounds' spread. (Binding the whole process with
    ``OMP_PROC_BIND`` measured the same, but binds the event loop and every thread started after it too.)
    ``allowed=False`` (``CpuOptions.bind_threads``) turns it off; with fewer CPUs than threads it stays off."""

    def __init__(self, cpus: list[int] | None = None, allowed: bool = True) -> None:
        self.cpus = _allowed_cpus() if cpus is None else list(cpus)
        self.allowed = allowed and len(self.cpus) > 1
        self.enabled = False
        self.bound = 0  # threads bound now (0: none)

    def apply(self, threads: int) -> None:
        """Called from the thread that runs the forward (the OpenMP team's master) with its thread count."""
        want = threads if self.enabled and self.allowed and 1 < threads <= len(self.cpus) else 0
        if want == self.bound:
            return
        from nxdserve.engine.models import cpu_kernels

        lib = cpu_kernels._library()
        if lib is None:
            return
        cpus = (ctypes.c_int * len(self.cpus))(*self.cpus)
        lib.omp_bind_team(max(threads, 1), cpus, len(self.cpus), 1 if want else 0)
        self.bound = want
