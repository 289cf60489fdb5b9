"""Scheduling policies (``--scheduling-policy``): the order of the waiting queue.

fcfs serves requests in arrival order. priority (vLLM V1's ``SchedulingPolicy.PRIORITY``) serves the lowest
``priority`` value first, ties by arrival time: the waiting queue stays sorted by ``priority_key``, and the
scheduler preempts the running request with the largest key when a better one waits for a slot (see
Scheduler's docstring for what triggers that here, and how it differs from vLLM).
"""

from __future__ import annotations

import bisect
from collections import deque

from nxdserve.config import SchedulingPolicy
from nxdserve.engine.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    """Smaller is served earlier and preempted later (vLLM: ``(priority, arrival_time)``)."""
    return request.priority, request.arrival_time


class WaitingQueue(deque[Request]):
    """The waiting requests, head first. The scheduler takes from the head and puts back at the head (a request it
    could not admit yet); ``add`` places a new or preempted request by the policy."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        super().__init__()
        self.by_priority = policy == "priority"

    def add(self, request: Request) -> None:
        if self.by_priority:  # after equal keys: arrival order among equals
            bisect.insort_right(self, request, key=priority_key)
        else:
            self.append(request)
