"""Running the app: engine start-up with progress, uvicorn, and a bounded drain on SIGTERM/SIGINT.

The server's event loop is uvloop where it is installed (a dependency on Linux and macOS; vLLM's server runs
on it too), and uvicorn parses HTTP with httptools where that is installed, as uvicorn's own "auto" picks.
On this project's 2-core CPU machine the loop shares the cores with the forward, so its CPU is the forward's.
Over workload a (64 streamed requests; three servers, 6 interleaved rounds) the loop thread used 0.31-0.33 CPU-s
with uvloop and httptools, 0.34-0.37 with asyncio and httptools, 0.35-0.37 with asyncio and h11; mean TTFT
190-208, 191-207 and 195-211 ms: the loop's CPU is ~10% less, the served figures inside their spread.
``--no-uvloop`` (or ``NXDSERVE_UVLOOP=0``, kept for scripts) keeps asyncio's loop (A/B measurements).

Shutdown order: the signal makes uvicorn stop listening; at the same moment the engine stops
accepting and lets in-flight requests finish for up to ``drain_timeout`` seconds, then aborts the
rest, which ends their responses; uvicorn then closes the connections (cancelling any handler still
running ``grace`` seconds later) and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn

from nxdserve.api.app import create_app
from nxdserve.api.engine_protocol import EngineClient
from nxdserve.api.multimodal import MediaOptions
from nxdserve.config import EngineConfig

logger = logging.getLogger("nxdserve.server")
T = TypeVar("T")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
_SHUTDOWN_GRACE_S = 3.0
_PROGRESS_INTERVAL_S = 5.0


def event_loop_factory(use_uvloop: bool | None = None) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor where uvloop is installed and not turned off, else None (asyncio's own).
    ``use_uvloop``: the --uvloop flag; None defers to NXDSERVE_UVLOOP (on unless "0")."""
    if use_uvloop is False or (use_uvloop is None and os.environ.get("NXDSERVE_UVLOOP", "1") == "0"):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_server_loop(main: Callable[[], Coroutine[Any, Any, T]], use_uvloop: bool | None = None) -> T:
    """Run ``main()`` to completion on a new event loop of ``event_loop_factory``'s kind."""
    with asyncio.Runner(loop_factory=event_loop_factory(use_uvloop)) as runner:
        return runner.run(main())


@dataclass
class ServeOptions:
    """The HTTP server's settings (vLLM's FrontendArgs that apply here)."""

    host: str = "0.0.0.0"
    port: int = 8000
    uds: str | None = None  # a Unix socket path: host and port are then unused
    api_key: str | list[str] | None = None  # one key, or several (any one is accepted)
    served_model_names: list[str] = field(default_factory=list)
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    log_requests: bool = True
    log_level: str = "info"
    uvicorn_log_level: str | None = None  # None: log_level
    access_log: bool = True
    access_log_exclude: list[str] = field(default_factory=list)  # paths without access log lines
    max_log_len: int | None = None  # prompt characters / token ids per request log line; None: all
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE
    ssl_ciphers: str | None = None
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    root_path: str = ""
    middleware: list[str] = field(default_factory=list)  # import paths of user ASGI middleware
    enable_docs: bool = True  # /openapi.json
    h11_max_incomplete_event_size: int | None = None
    uvloop: bool | None = None  # None: NXDSERVE_UVLOOP decides
    log_config_file: str | None = None
    media: MediaOptions = field(default_factory=MediaOptions)  # image sources and limits (api.multimodal)

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"


class _DrainingServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, engine: EngineClient, drain_timeout: float, on_ready: Callable[[], None]
    ):
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.on_ready = on_ready

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # serve() owns the signal handlers: uvicorn's re-raise the signal after shutdown, which
        # would turn a clean drain into a death by SIGTERM.
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_ready()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = asyncio.create_task(self.engine.shutdown(drain_timeout=self.drain_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            await drain

    def bound_port(self) -> int | None:
        for server in self.servers:
            for sock in server.sockets:
                if sock.family in (socket.AF_INET, socket.AF_INET6):  # not a --uds socket
                    return int(sock.getsockname()[1])
        return None


async def _report_progress(started: float) -> None:
    while True:
        await asyncio.sleep(_PROGRESS_INTERVAL_S)
        logger.info("still loading the model ... %.0fs", time.monotonic() - started)


async def start_engine(engine_config: EngineConfig) -> EngineClient:
    """Create and start an AsyncEngine, logging progress while the model loads."""
    from nxdserve.engine.dp import create_engine

    started = time.monotonic()
    logger.info("loading model %s ...", engine_config.model or "(embedded default model)")
    engine = create_engine(engine_config)  # an AsyncEngine, or data-parallel engine processes
    progress = asyncio.create_task(_report_progress(started))
    try:
        await engine.start()
    finally:
        progress.cancel()
    cfg = engine.config
    logger.info(
        "model loaded in %.1fs: %s, backend=%s, scheduling=%s",
        time.monotonic() - started,
        engine.model_path,
        engine.backend_name,
        cfg.scheduling_mode,
    )
    logger.info("effective configuration: %s", json.dumps(dataclasses.asdict(cfg), default=str, sort_keys=True))
    return engine


def _freeze_startup_heap() -> None:
    """Move everything loading created (torch, transformers, the tokenizer: ~300k objects) out of the cyclic
    collector's reach. Otherwise each full collection while serving walks all of it with the GIL held: on the
    default model, 32 concurrent streams triggered full collections of up to 250 ms, stalling every stream."""
    gc.collect()
    gc.freeze()


class _ExcludePaths(logging.Filter):
    """Drops uvicorn access log records for the given paths (--disable-access-log-for-endpoints)."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record args: (client, method, path with query, http version, status)
        if isinstance(args, tuple) and len(args) >= 3:
            return str(args[2]).split("?", 1)[0] not in self.paths
        return True


def _uvicorn_config(app: Any, opts: ServeOptions) -> uvicorn.Config:
    extra: dict[str, Any] = {}
    if opts.h11_max_incomplete_event_size is not None:
        extra["h11_max_incomplete_event_size"] = opts.h11_max_incomplete_event_size
    if opts.ssl_ciphers:
        extra["ssl_ciphers"] = opts.ssl_ciphers
    config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        uds=opts.uds,
        log_level=(opts.uvicorn_log_level or opts.log_level).lower(),
        log_config=None if opts.log_config_file else uvicorn.config.LOGGING_CONFIG,
        access_log=opts.access_log,
        root_path=opts.root_path,
        ssl_keyfile=opts.ssl_keyfile,
        ssl_certfile=opts.ssl_certfile,
        ssl_ca_certs=opts.ssl_ca_certs,
        ssl_cert_reqs=opts.ssl_cert_reqs,
        lifespan="off",  # the engine's life is managed here, around uvicorn
        timeout_graceful_shutdown=int(opts.drain_timeout + _SHUTDOWN_GRACE_S),
        timeout_keep_alive=30,
        **extra,
    )
    access = logging.getLogger("uvicorn.access")
    for old in [f for f in access.filters if isinstance(f, _ExcludePaths)]:  # a previous server's, in-process
        access.removeFilter(old)
    if opts.access_log_exclude:
        access.addFilter(_ExcludePaths(opts.access_log_exclude))
    return config


async def serve(engine_config: Any, opts: ServeOptions) -> int:
    """Load, serve until SIGTERM/SIGINT, drain, exit code 0."""
    loop = asyncio.get_running_loop()
    server: _DrainingServer | None = None
    stop_requested = False

    def on_signal(sig: signal.Signals) -> None:
        nonlocal stop_requested
        if server is None:
            stop_requested = True
            logger.info("%s received while loading; exiting once the model is loaded", sig.name)
        elif server.should_exit and sig == signal.SIGINT:
            logger.warning("second SIGINT: exiting without waiting for requests")
            server.force_exit = True
            server.engine.abort_all()  # ends the engine's drain too
        else:
            logger.info("%s received: draining in-flight requests (up to %.0fs)", sig.name, opts.drain_timeout)
            server.should_exit = True

    handled = (signal.SIGINT, signal.SIGTERM)
    for sig in handled:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        engine = await start_engine(engine_config)
        if stop_requested:
            await engine.shutdown(drain_timeout=0)
            return 0
        app = create_app(
            engine, opts.served_model_names or None, opts.api_key, log_requests=opts.log_requests, opts=opts
        )
        names = app.state.nxdserve.served_model_names
        _freeze_startup_heap()

        def ready() -> None:
            assert server is not None
            port = server.bound_port() or opts.port
            host = "127.0.0.1" if opts.host in ("0.0.0.0", "", "::") else opts.host
            where = f"unix:{opts.uds}" if opts.uds else f"{opts.scheme}://{host}:{port}{opts.root_path}/v1"
            print(
                f"nxdserve ready: {', '.join(names)} at {where} "
                f"(backend={engine.backend_name}, scheduling={engine.config.scheduling_mode})",
                flush=True,
            )

        server = _DrainingServer(_uvicorn_config(app, opts), engine, opts.drain_timeout, ready)
        await server.serve()
        if not server.started:  # e.g. the port is taken: uvicorn logged why
            await engine.shutdown(drain_timeout=0)
            return 1
        logger.info("shut down cleanly")
        return 0
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)


class BackgroundServer:
    """Engine and server on a private event loop in a daemon thread: for tests and notebooks.

    ``call_soon(fn)`` runs ``fn`` on the server's loop (the engine is not thread-safe)."""

    def __init__(self, engine_config: Any, opts: ServeOptions | None = None) -> None:
        self.engine_config = engine_config
        self.opts = opts or ServeOptions(host="127.0.0.1", port=0, log_requests=False, log_level="warning")
        self.engine: EngineClient | None = None
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: _DrainingServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="nxdserve-server", daemon=True)

    @property
    def url(self) -> str:
        return f"{self.opts.scheme}://{self.opts.host}:{self.port}"

    def start(self, timeout: float = 600.0) -> BackgroundServer:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the server did not start in time")
        if self._error is not None:
            raise RuntimeError("the server failed to start") from self._error
        return self

    def call_soon(self, fn: Callable[[], Any]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn)

    def stop(self, timeout: float = 60.0) -> None:
        if self._server is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(setattr, self._server, "should_exit", True)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            run_server_loop(self._main, use_uvloop=self.opts.uvloop)
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            self.engine = await start_engine(self.engine_config)
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            raise
        app = create_app(self.engine, self.opts.served_model_names or None, self.opts.api_key, opts=self.opts)

        def ready() -> None:
            assert self._server is not None
            self.port = self._server.bound_port()
            self._ready.set()

        self._server = _DrainingServer(_uvicorn_config(app, self.opts), self.engine, self.opts.drain_timeout, ready)
        await self._server.serve()
