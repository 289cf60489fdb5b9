"""Polls the server's Prometheus /metrics during a run for running / waiting request counts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

# Gauge names per server family: vLLM and nxdserve share vLLM's names; llama.cpp's server has its own.
RUNNING_GAUGES = ("vllm:num_requests_running", "llamacpp:requests_processing")
WAITING_GAUGES = ("vllm:num_requests_waiting", "llamacpp:requests_deferred")


@dataclass
class LoadSample:
    time: float  # perf_counter
    running: float | None
    waiting: float | None


def parse_load_gauges(text: str) -> tuple[float | None, float | None]:
    """(running, waiting) from Prometheus text, summed over label sets (one per engine / model)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in RUNNING_GAUGES or family.name in WAITING_GAUGES:
            # Only the bare samples: a histogram-like family would also carry _bucket/_sum samples.
            total = sum(s.value for s in family.samples if s.name == family.name)
            found[family.name] = found.get(family.name, 0.0) + total

    def first(names: tuple[str, ...]) -> float | None:
        return next((found[n] for n in names if n in found), None)

    return first(RUNNING_GAUGES), first(WAITING_GAUGES)


class LoadMonitor:
    """Background task sampling /metrics every ``interval_s``; gives up quietly if the endpoint is missing."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, interval_s: float = 0.5) -> None:
        self.base_url = base_url
        self.headers = headers or {}
        self.interval_s = interval_s
        self.samples: list[LoadSample] = []
        self.available = True
        self.note = ""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> list[LoadSample]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        return self.samples

    async def _run(self) -> None:
        # Its own connection, so polling never queues behind the benchmark's saturated pool.
        async with httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers, timeout=5.0, trust_env=False
        ) as client:
            while True:
                t0 = time.perf_counter()
                try:
                    resp = await client.get("/metrics")
                    if resp.status_code != 200:
                        self._give_up(f"GET /metrics returned HTTP {resp.status_code}")
                        return
                    running, waiting = parse_load_gauges(resp.text)
                    if running is None and waiting is None:
                        self._give_up("/metrics has no running/waiting request gauges")
                        return
                    self.samples.append(LoadSample(t0, running, waiting))
                except httpx.HTTPError as exc:
                    logger.debug("metrics poll failed: %r", exc)  # transient under load; keep polling
                except ValueError as exc:
                    self._give_up(f"cannot parse /metrics: {exc}")
                    return
                await asyncio.sleep(max(0.0, self.interval_s - (time.perf_counter() - t0)))

    def _give_up(self, why: str) -> None:
        self.available = False
        self.note = why
        logger.warning("server load not sampled: %s", why)
