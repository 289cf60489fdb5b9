"""One data-parallel engine process: an AsyncEngine on its own cores, driven over a pipe (see protocol.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

from nxdserve.config import EngineConfig
from nxdserve.engine.dp.placement import Placement
from nxdserve.engine.dp.protocol import EngineFacts, to_wire

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25


def run_engine_process(config: EngineConfig, placement: Placement, conn: Connection, log_level: int) -> None:
    """The process's entry point (spawned: nothing of the API process's state is inherited)."""
    # The API process decides when engines stop (its drain on SIGTERM, or its pipe closing if it dies): a Ctrl-C
    # that reaches the whole process group must not kill the engines under requests that are draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    placement.apply()
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [engine {placement.index}] "
                                                "%(name)s: %(message)s")
    threads = config.num_threads or max(1, len(placement.cpus))
    config = dataclasses.replace(config, data_parallel_size=1, num_threads=threads)
    try:
        asyncio.run(_EngineProcess(config, placement.index, conn).run())
    except Exception as exc:
        logger.exception("engine %d failed", placement.index)
        with contextlib.suppress(OSError):
            conn.send(("fatal", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc


class _EngineProcess:
    def __init__(self, config: EngineConfig, index: int, conn: Connection) -> None:
        self.config = config
        self.index = index
        self.conn = conn
        self.forwards: dict[str, asyncio.Task[None]] = {}

    def send(self, message: tuple[Any, ...]) -> None:
        self.conn.send(message)

    async def run(self) -> None:
        from nxdserve.engine.async_engine import AsyncEngine

        engine = AsyncEngine(self.config)
        await engine.start()
        core = engine.core
        assert core is not None
        self.send(("ready", EngineFacts(
            model_path=engine.model_path, backend_name=engine.backend_name, max_model_len=core.max_model_len,
            max_prompt_len=core.max_prompt_len, vocab_size=core.vocab_size, max_num_seqs=core.num_slots,
            generation_defaults=dict(engine.generation_defaults), pid=os.getpid(),
            request_check=core.backend.request_check(), enable_chunked_prefill=engine.config.enable_chunked_prefill,
            max_num_batched_tokens=engine.config.max_num_batched_tokens)))
        inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, args=(loop, inbox), name="dp-engine-reader", daemon=True).start()
        reporter = asyncio.create_task(self._report(engine))
        try:
            while True:
                message = await inbox.get()
                kind = message[0]
                if kind == "add":
                    self._add(engine, *message[1:])
                elif kind == "abort":
                    engine.abort(message[1])
                elif kind == "shutdown":
                    await engine.shutdown(drain_timeout=message[1])
                    for task in list(self.forwards.values()):
                        with contextlib.suppress(BaseException):
                            await task
                    self.send(("bye",))
                    return
        finally:
            reporter.cancel()

    def _read(self, loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue[tuple[Any, ...]]) -> None:
        """Blocking reads in a thread; the API process closing the pipe (it died) counts as an immediate stop."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = ("shutdown", 0.0)
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "shutdown":
                return

    def _add(self, engine: Any, request_id: str, prompt: str | list[int], params: Any, add_special: bool,
             priority: int = 0) -> None:
        try:
            stream = engine.add_request(prompt, params, request_id=request_id, add_special_tokens=add_special,
                                        priority=priority)
        except Exception as exc:
            self.send(("error", request_id, to_wire(exc)))
            return
        self.forwards[request_id] = asyncio.create_task(self._forward(request_id, stream))

    async def _forward(self, request_id: str, stream: Any) -> None:
        try:
            async for out in stream:
                self.send(("out", request_id, out))
        except Exception as exc:
            self.send(("error", request_id, to_wire(exc)))
        finally:
            self.forwards.pop(request_id, None)

    async def _report(self, engine: Any) -> None:
        """Stats and this engine's Prometheus exposition (when it changed) for the API process's /metrics;
        exits the process when the engine loop died, so the API process restarts it."""
        from prometheus_client import generate_latest

        last_text: bytes | None = None
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            if not engine.is_healthy:
                logger.error("engine %d: the engine loop died (%s); exiting", self.index, engine.dead_error)
                os._exit(3)
            stats = engine.stats()
            engine.metrics.record_step(stats.num_running, stats.num_waiting, stats.kv_cache_usage, 0, 0)
            text = generate_latest(engine.metrics.registry)
            self.send(("stats", stats, text.decode() if text != last_text else None))
            last_text = text
