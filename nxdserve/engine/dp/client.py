"""DataParallelEngine: N engine processes behind one API server, as vLLM's ``--data-parallel-size``.

The API process loads only the tokenizer; each engine process (worker.py) owns a model on its own cores (or
NeuronCores). A request goes to the ready engine with the fewest outstanding requests (least outstanding
requests, counted here as requests are sent and finish, so a burst spreads before any engine reports back).
A process that dies ends its streams with an error, takes no new requests, and is started again, up to
``max_restarts`` times; after that /health reports unhealthy. The public surface is AsyncEngine's
(``start``, ``generate``, ``add_request``, ``abort``, ``shutdown``, ``is_healthy``, ``stats``, ``metrics``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

from nxdserve.config import EngineConfig
from nxdserve.engine.async_engine import AsyncEngine, RequestStream
from nxdserve.engine.core import EngineCore, EngineStats
from nxdserve.engine.dp.metrics import labelled_registry
from nxdserve.engine.dp.placement import Placement, plan
from nxdserve.engine.dp.protocol import EngineFacts, from_wire
from nxdserve.engine.dp.worker import run_engine_process
from nxdserve.engine.prompts import PromptInput, parse_prompt
from nxdserve.engine.structured import GrammarCompiler
from nxdserve.errors import EngineDeadError, InvalidRequestError, QueueFullError
from nxdserve.lora.request import LoRARequest
from nxdserve.model_files import eos_token_ids
from nxdserve.sampling_params import SamplingParams
from nxdserve.tools.flags import read_chat_template

logger = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3
_EXIT_WAIT_S = 10.0
_NO_LORA = "LoRA adapters are not served with --data-parallel-size > 1 (run one server per replica)."


@dataclass
class _EngineProcessHandle:
    placement: Placement
    generation: int = 0
    process: Any = None
    conn: Connection | None = None
    facts: EngineFacts | None = None
    ready: bool = False
    gave_up: bool = False
    restarts: int = 0
    last_error: str | None = None
    streams: dict[str, RequestStream] = field(default_factory=dict)
    stats: EngineStats | None = None
    metrics_text: str = ""
    started: asyncio.Future[None] | None = None

    @property
    def index(self) -> int:
        return self.placement.index


class _FleetMetrics:
    """The engines' own metrics, relabelled; their gauges are refreshed by the engines themselves."""

    def __init__(self, engine: DataParallelEngine) -> None:
        self.registry = labelled_registry(engine.metrics_texts, "engine")

    def record_step(self, *args: Any) -> None:
        """The API's /metrics asks a single engine to refresh its gauges; each engine process already
        refreshes its own before it reports (worker.STATS_INTERVAL_S)."""


class DataParallelEngine:
    def __init__(self, config: EngineConfig, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 placements: list[Placement] | None = None) -> None:
        self.config = config
        self.max_restarts = max_restarts
        size = config.data_parallel_size
        placements = placements or plan(size, config.tensor_parallel_size, config.backend)
        self.handles = [_EngineProcessHandle(p) for p in placements]
        self._owner: dict[str, _EngineProcessHandle] = {}
        self._choice_ids: dict[str, list[str]] = {}  # as AsyncEngine's: read by the shared generate and abort
        self._accepting = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mp = multiprocessing.get_context("spawn")  # never fork a process that holds torch's threads
        self.tokenizer: Any = None
        self.chat_template: str | None = None  # --chat-template's text; None: the tokenizer's own
        # Structured outputs are checked here too, off the loop, so a bad spec is a 400 before a stream exists.
        self._grammars: GrammarCompiler | None = None
        self.model_path = ""
        self.generation_defaults: dict[str, float | int] = {}
        self.dead_error: BaseException | None = None
        self.metrics = _FleetMetrics(self)
        self._restarts: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        from nxdserve.engine.loader import load_model_files

        self._loop = asyncio.get_running_loop()
        # Resolve the model once here (a GGUF is converted once, under its lock) before the engines load it.
        files = await asyncio.to_thread(load_model_files, self.config)
        self.tokenizer = files.tokenizer
        self.chat_template = read_chat_template(self.config.chat_template)
        for handle in self.handles:
            self._spawn(handle)
        try:
            await asyncio.gather(*(h.started for h in self.handles if h.started is not None))
        except BaseException:
            await self.shutdown(drain_timeout=0)
            raise
        facts = self._facts
        # Report the scheduling the engines run (the nxd backend's prefill-first fallback), not the one asked
        self.config.enable_chunked_prefill = facts.enable_chunked_prefill
        self.config.max_num_batched_tokens = facts.max_num_batched_tokens
        eos = eos_token_ids(facts.model_path, self.tokenizer)  # what each engine's core gathers too
        self._grammars = GrammarCompiler(self.tokenizer, facts.vocab_size, eos)
        self.model_path = facts.model_path
        self.generation_defaults = dict(facts.generation_defaults)
        self._accepting = True
        logger.info("data parallel: %d engines ready (pids %s)", len(self.handles),
                    [h.facts.pid for h in self.handles if h.facts])

    def _spawn(self, handle: _EngineProcessHandle) -> None:
        assert self._loop is not None
        handle.generation += 1
        ours, theirs = self._mp.Pipe(duplex=True)
        process = self._mp.Process(
            target=run_engine_process,
            args=(self.config, handle.placement, theirs, logging.getLogger().getEffectiveLevel()),
            name=f"nxdserve-engine-{handle.index}",
            daemon=True,
        )
        process.start()
        theirs.close()
        handle.process, handle.conn, handle.ready = process, ours, False
        handle.started = self._loop.create_future()
        threading.Thread(target=self._read, args=(handle, handle.generation, ours), daemon=True,
                         name=f"dp-reader-{handle.index}").start()

    def _read(self, handle: _EngineProcessHandle, generation: int, conn: Connection) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
                    loop.call_soon_threadsafe(self._on_exit, handle, generation)
                return
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._on_message, handle, generation, message)

    async def shutdown(self, drain_timeout: float | None = None) -> None:
        """Stop accepting; each engine drains for up to ``drain_timeout`` then aborts what is left."""
        self._accepting = False
        for task in list(self._restarts):
            task.cancel()
        for handle in self.handles:
            if handle.conn is not None and handle.process is not None and handle.process.is_alive():
                with contextlib.suppress(OSError):
                    handle.conn.send(("shutdown", float(drain_timeout or 0.0)))
        wait = float(drain_timeout or 0.0) + _EXIT_WAIT_S
        for handle in self.handles:
            process = handle.process
            if process is None:
                continue
            await asyncio.to_thread(process.join, wait)
            if process.is_alive():
                logger.warning("engine %d did not exit; killing it", handle.index)
                process.kill()  # engine processes ignore SIGTERM (worker.run_engine_process)
                await asyncio.to_thread(process.join, 5.0)
        for handle in self.handles:
            self._fail_streams(handle, EngineDeadError("the server is shutting down"))
            if handle.conn is not None:
                handle.conn.close()

    # -- messages from the engines ------------------------------------------------------------------
    def _on_message(self, handle: _EngineProcessHandle, generation: int, message: tuple[Any, ...]) -> None:
        if generation != handle.generation:
            return
        kind = message[0]
        if kind == "out":
            _, request_id, out = message
            stream = handle.streams.get(request_id)
            if stream is None:
                return
            if out.finished:
                self._release(handle, request_id)
            stream.put(out)
        elif kind == "error":
            _, request_id, wire = message
            stream = self._release(handle, request_id)
            if stream is not None:
                stream.put(from_wire(wire))
        elif kind == "stats":
            handle.stats = message[1]
            if message[2] is not None:
                handle.metrics_text = message[2]
        elif kind == "ready":
            handle.facts, handle.ready = message[1], True
            if handle.started is not None and not handle.started.done():
                handle.started.set_result(None)
        elif kind == "fatal":
            handle.last_error = message[1]

    def _on_exit(self, handle: _EngineProcessHandle, generation: int) -> None:
        if generation != handle.generation:
            return
        handle.ready = False
        code = handle.process.exitcode if handle.process is not None else None
        reason = f"data-parallel engine {handle.index} died"
        if handle.last_error:
            reason += f": {handle.last_error}"
        self._fail_streams(handle, EngineDeadError(reason))
        if handle.started is not None and not handle.started.done():
            handle.started.set_exception(EngineDeadError(f"data-parallel engine {handle.index} failed to start: "
                                                         f"{handle.last_error or 'it exited'}"))
            return
        if not self._accepting:
            return
        logger.error("%s (exit code %s)", reason, code)
        if handle.restarts >= self.max_restarts:
            handle.gave_up = True
            self.dead_error = EngineDeadError(f"{reason}; not restarted after {handle.restarts} restarts")
            return
        task = asyncio.get_running_loop().create_task(self._restart(handle))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, handle: _EngineProcessHandle) -> None:
        if handle.process is not None:
            await asyncio.to_thread(handle.process.join, _EXIT_WAIT_S)
        handle.restarts += 1
        handle.last_error = None
        logger.warning("restarting data-parallel engine %d (restart %d of %d)", handle.index, handle.restarts,
                       self.max_restarts)
        self._spawn(handle)
        try:
            assert handle.started is not None
            await handle.started
        except EngineDeadError as exc:
            logger.error("%s", exc)

    def _release(self, handle: _EngineProcessHandle, request_id: str) -> RequestStream | None:
        self._owner.pop(request_id, None)
        return handle.streams.pop(request_id, None)

    def _fail_streams(self, handle: _EngineProcessHandle, error: Exception) -> None:
        streams, handle.streams = handle.streams, {}
        for request_id, stream in streams.items():
            self._owner.pop(request_id, None)
            stream.put(error)

    # -- requests ----------------------------------------------------------------------------------
    def _pick(self) -> _EngineProcessHandle:
        ready = [h for h in self.handles if h.ready]
        if not ready:
            raise EngineDeadError("no data-parallel engine is ready (restarting or dead)")
        return min(ready, key=lambda h: len(h.streams))

    def _validate(self, handle: _EngineProcessHandle, token_ids: list[int], params: SamplingParams,
                  request_id: str, priority: int = 0) -> None:
        """The engine's own admission checks, here, so a bad request is refused before a stream exists (a 400
        with its ``param``, as with one engine). The engine process checks again, backend specifics included."""
        facts = handle.facts
        assert facts is not None
        if self._in_flight(request_id):
            raise InvalidRequestError(f"Request id {request_id!r} is already in flight.", param="request_id")
        stand_in = SimpleNamespace(
            scheduler=SimpleNamespace(requests={}, waiting=[]), vocab_size=facts.vocab_size, config=self.config,
            backend=SimpleNamespace(validate_request=facts.request_check or (lambda _params: None)),
            max_prompt_len=facts.max_prompt_len,
            structured=SimpleNamespace(compiler=self._grammars),
            max_model_len=facts.max_model_len, eos_token_ids=frozenset(),
        )
        EngineCore.make_request(stand_in, token_ids, params, request_id, priority=priority)  # type: ignore[arg-type]
        if self.config.max_waiting is not None and len(handle.streams) >= facts.max_num_seqs + self.config.max_waiting:
            raise QueueFullError(f"The waiting queue is full ({self.config.max_waiting} requests); retry later.")

    def add_request(self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None,
                    add_special_tokens: bool = True, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> RequestStream:
        """Validate and send to the least loaded engine now; raises a typed error instead of returning a stream."""
        import uuid

        if not self._accepting:
            raise EngineDeadError("the engine is not accepting requests (starting or shutting down)")
        if lora_request is not None:  # refused at start-up too (dp.args): each engine would hold its own adapters
            raise InvalidRequestError(_NO_LORA, param="model")
        parsed = parse_prompt(prompt)
        if parsed.images or parsed.mm_inputs is not None:  # the engines serve text-only models (accepts_images)
            raise InvalidRequestError(
                "multi_modal_data: the served model is a text-only model and takes no images.", param="multi_modal_data"
            )
        prompt = parsed.token_ids if parsed.token_ids is not None else (parsed.text or "")
        handle = self._pick()
        request_id = request_id or uuid.uuid4().hex
        token_ids = self.encode(prompt, add_special_tokens) if isinstance(prompt, str) and prompt else prompt
        self._validate(handle, list(token_ids or []), dataclasses.replace(params), request_id, priority)
        stream = RequestStream(self, request_id, merge_deltas=False)  # outputs arrive one message each
        assert handle.conn is not None
        try:
            handle.conn.send(("add", request_id, prompt, params, add_special_tokens, priority))
        except OSError as exc:
            raise EngineDeadError(f"data-parallel engine {handle.index} is gone: {exc}") from exc
        handle.streams[request_id] = stream
        self._owner[request_id] = handle
        return stream

    async def prepare(self, params: SamplingParams) -> None:
        """Compile a structured-outputs grammar off the event loop (the engine process compiles its own)."""
        if params.structured_outputs is not None and self._grammars is not None:
            await self._grammars.compile_async(params.structured_outputs)

    async def process_prompt(self, prompt: PromptInput, add_special_tokens: bool = True) -> PromptInput:
        """Prompts pass as they are: images are refused by ``add_request`` (the engines take none over the pipe)."""
        return prompt

    async def add_lora(self, lora_request: LoRARequest) -> None:
        raise InvalidRequestError(_NO_LORA, param="lora_name")

    async def remove_lora(self, lora_name: str) -> None:
        raise InvalidRequestError(_NO_LORA, param="lora_name")

    def list_loras(self) -> list[LoRARequest]:
        return []

    generate = AsyncEngine.generate
    apply_chat_template = AsyncEngine.apply_chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def abort(self, request_id: str) -> None:
        """Idempotent; unknown ids are ignored. The engine answers with the request's final "abort" output. An
        n > 1 request's own id aborts all its choices."""
        for choice_id in self._choice_ids.get(request_id, ()):
            self.abort(choice_id)
        handle = self._owner.get(request_id)
        if handle is not None and handle.conn is not None:
            with contextlib.suppress(OSError):
                handle.conn.send(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request in flight (a drain cut short: the server's second Ctrl-C)."""
        for request_id in list(self._owner):
            self.abort(request_id)

    def _in_flight(self, request_id: str) -> bool:
        """As AsyncEngine's: a request or an n > 1 request's choice in flight (read by the shared generate)."""
        return request_id in self._owner or request_id in self._choice_ids

    # -- what the API reads --------------------------------------------------------------------------
    @property
    def _facts(self) -> EngineFacts:
        for handle in self.handles:
            if handle.facts is not None:
                return handle.facts
        raise EngineDeadError("no data-parallel engine has started")

    @property
    def is_healthy(self) -> bool:
        return self._accepting and not any(h.gave_up for h in self.handles) and any(h.ready for h in self.handles)

    @property
    def max_model_len(self) -> int:
        return self._facts.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._facts.vocab_size

    @property
    def backend_name(self) -> str:
        return self._facts.backend_name

    def outstanding(self) -> list[int]:
        """Requests in flight per engine (what the router balances)."""
        return [len(h.streams) for h in self.handles]

    def metrics_texts(self) -> Mapping[str, str]:
        return {str(h.index): h.metrics_text for h in self.handles if h.metrics_text}

    def stats(self) -> EngineStats:
        """The engines' latest reported stats, added up (timings are per engine and left out)."""
        reported = [h.stats for h in self.handles if h.stats is not None]
        total = EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0)
        for s in reported:
            total.num_running += s.num_running
            total.num_waiting += s.num_waiting
            total.num_slots_used += s.num_slots_used
            total.num_slots += s.num_slots
            total.prompt_tokens_total += s.prompt_tokens_total
            total.generation_tokens_total += s.generation_tokens_total
            total.num_finished_total += s.num_finished_total
        if total.num_slots:  # each engine's usage weighed by its size
            total.kv_cache_usage = sum(s.kv_cache_usage * s.num_slots for s in reported) / total.num_slots
        return total
