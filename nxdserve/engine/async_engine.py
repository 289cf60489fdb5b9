"""AsyncEngine: the embedded API. One engine-loop task drives EngineCore's step order (``launch`` /
``complete``) with overlap; the model forward and drafting run in a worker thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from nxdserve.config import EngineConfig
from nxdserve.engine.choices import MAX_CHOICES, ParentOutputs, abort_all, child_params, merge
from nxdserve.engine.core import (
    AwaitForwardStarted,
    AwaitResult,
    Driven,
    EngineCore,
    EngineStats,
    InFlightStep,
    RunInWorker,
)
from nxdserve.engine.outputs import RequestOutput
from nxdserve.engine.prompts import ParsedPrompt, ProcessedPrompt, PromptInput, parse_prompt
from nxdserve.engine.request import Request
from nxdserve.errors import EngineDeadError, InvalidRequestError
from nxdserve.lora.request import LoRARequest
from nxdserve.sampling_params import OutputKind, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
_LOG_INTERVAL_S = 10.0


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Fold a later delta output into an earlier one (a slow consumer gets one combined delta)."""
    ca, cb = a.outputs[0], b.outputs[0]
    ca.text += cb.text
    ca.token_ids = ca.token_ids + cb.token_ids
    ca.cumulative_num_tokens = cb.cumulative_num_tokens
    if cb.logprobs is not None:
        ca.logprobs = (ca.logprobs or []) + cb.logprobs
    ca.finish_reason, ca.stop_reason = cb.finish_reason, cb.stop_reason
    a.finished = b.finished
    a.error = b.error
    a.metrics = b.metrics
    if a.prompt_logprobs is None:
        a.prompt_logprobs = b.prompt_logprobs
    return a


class _Aborts(Protocol):
    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """Async iterator over one request's outputs (from AsyncEngine or the data-parallel engine). Closing it
    before the end aborts the request."""

    def __init__(self, engine: _Aborts, request_id: str, merge_deltas: bool) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._merge = merge_deltas
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while self._merge and isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            nxt = self._queue.get_nowait()
            if isinstance(nxt, BaseException):
                item = nxt
                break
            item = _merge(item, nxt)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()


# apply_chat_template's own arguments (and the template's messages): not template variables a request may set
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "tokenize", "add_generation_prompt", "continue_final_message", "tools", "documents",
    "conversation", "messages", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core: EngineCore | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._streams: dict[str, RequestStream] = {}
        # An n > 1 request's id -> its choices' engine ids, while it runs (abort takes either)
        self._choice_ids: dict[str, list[str]] = {}
        self._wakeup = asyncio.Event()
        self._accepting = False
        self._stopping = False
        self.dead_error: BaseException | None = None
        self.model_path = ""
        self.tokenizer: Any = None
        self.generation_defaults: dict[str, float | int] = {}
        self._last_log = time.monotonic()
        self._last_log_tokens = (0, 0)
        # The loop's wait for the next forward to enter the model's compute: the worker thread sets the flag,
        # then wakes the loop only if it finds a waiter (the loop sets the waiter, then reads the flag; the GIL
        # orders the four), so a step launched with nobody waiting costs no cross-thread wake-up.
        self._forward_started: asyncio.Future[None] | None = None
        self._forward_has_started = False
        self._forward: asyncio.Future[Any] | None = None  # the last forward started in the worker thread
        self.chat_template: str | None = None  # --chat-template's text; None: the tokenizer's own
        self._lora_loads: set[asyncio.Task[None]] = set()  # requests waiting for their adapter's weights
        self.image_processor: Any = None  # the model's ImagePromptProcessor (mm_inputs.py), when it takes images

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        from nxdserve.engine.loader import build_engine_core

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nxdserve-model")
        loop = asyncio.get_running_loop()
        # Load in the model thread: heavy, and some backends bind state to the thread that loads them.
        core, files = await loop.run_in_executor(self._executor, build_engine_core, self.config)
        self.core = core
        await loop.run_in_executor(self._executor, core.backend.own_thread)
        self.model_path = str(files.path)
        self.tokenizer = files.tokenizer
        self.generation_defaults = files.generation_defaults
        from nxdserve.tools.flags import read_chat_template

        self.chat_template = read_chat_template(self.config.chat_template)
        if core.capabilities.image_inputs:
            from nxdserve.engine.mm_inputs import ImagePromptProcessor

            image_token_id = int(files.hf_config.image_token_id)
            self.image_processor = await asyncio.to_thread(ImagePromptProcessor, files.path, image_token_id)
        for lora_request in self.config.lora_modules:  # --lora-modules
            await self.add_lora(lora_request)
        self._accepting = True
        core.backend.forward_started = lambda: self._on_forward_started(loop)
        self._loop_task = asyncio.create_task(self._run_loop(), name="nxdserve-engine-loop")
        logger.info(
            "engine ready: backend=%s mode=%s max_model_len=%d max_num_seqs=%d max_num_batched_tokens=%d",
            self.backend_name, self.config.scheduling_mode, self.max_model_len, core.num_slots,
            self.config.max_num_batched_tokens,
        )

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def shutdown(self, drain_timeout: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish for up to drain_timeout, abort the rest."""
        self._accepting = False
        if drain_timeout and self.core is not None and self._loop_task is not None:
            deadline = time.monotonic() + drain_timeout
            while self.core.has_unfinished and not self._loop_task.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        self._stopping = True
        self._wakeup.set()
        if self._loop_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        if self.core is not None:
            self.core.structured.compiler.shutdown()
            self.core.structured.shutdown()
        if self._executor is not None:
            if self.core is not None:
                self._executor.submit(self.core.backend.shutdown)
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- properties the API reads ----------------------------------------------------------------
    @property
    def _core(self) -> EngineCore:
        if self.core is None:
            raise EngineDeadError("the engine is not started")
        return self.core

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self._loop_task is not None and not self._loop_task.done()

    @property
    def vocab_size(self) -> int:
        return self._core.vocab_size

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def accepts_images(self) -> bool:
        """Whether prompts may carry images (the API's image parts and ``multi_modal_data``)."""
        return bool(self._core.capabilities.image_inputs)

    @property
    def backend_name(self) -> str:
        return self._core.backend.name

    @property
    def metrics(self) -> Any:
        return self._core.metrics

    def stats(self) -> EngineStats:
        return self._core.stats()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        from nxdserve.tools.flags import check_chat_template_flags

        check_chat_template_flags(add_generation_prompt, continue_final_message)
        reserved = sorted(set(chat_template_kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:  # else they would override the server's template or its own arguments, or fail inside it
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: these are the request's own fields or "
                "the server's (--chat-template); the kwargs are the template's extra variables.",
                param="chat_template_kwargs",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                **({"chat_template": self.chat_template} if self.chat_template is not None else {}),
                **(chat_template_kwargs or {}),
            )
        except Exception as exc:  # jinja errors, bad roles: the caller's input
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
        return str(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # -- requests ----------------------------------------------------------------------------------
    async def process_prompt(self, prompt: PromptInput, add_special_tokens: bool = True) -> PromptInput:
        """A prompt with images through the model's processor in a worker thread (resizing, patching, image
        token expansion): a ``ProcessedPrompt`` that ``add_request`` takes without further work. Other
        prompts come back as they are. InvalidRequestError for images the model cannot take."""
        parsed = parse_prompt(prompt)
        if not parsed.images:
            return prompt
        return await asyncio.to_thread(self._process_images, parsed, add_special_tokens)

    def _process_images(self, parsed: ParsedPrompt, add_special_tokens: bool) -> ProcessedPrompt:
        processor = self.image_processor
        if processor is None:
            raise InvalidRequestError(
                "multi_modal_data: the served model is a text-only model and takes no images.", param="multi_modal_data"
            )
        if parsed.token_ids is not None:
            token_ids = parsed.token_ids
        else:
            token_ids = self.encode(parsed.text, add_special_tokens) if parsed.text else []
        expanded, mm_inputs = processor.process(token_ids, parsed.images)
        return ProcessedPrompt(expanded, mm_inputs, parsed.text)

    async def prepare(self, params: SamplingParams) -> None:
        """Work a request needs before ``add_request`` that must not run on the event loop: compiling its
        structured-outputs grammar (cached; a bad spec or a compile past the time limit raises
        InvalidRequestError naming the parameter)."""
        if params.structured_outputs is not None:
            await self._core.structured.compiler.compile_async(params.structured_outputs)

    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Validate and enqueue now; raises a typed error instead of returning a stream. With ``lora_request``
        (registered on first use, as vLLM does), a request whose adapter's weights are not in host memory is
        enqueued once a worker thread has read them."""
        if self.dead_error is not None or (self._loop_task is not None and self._loop_task.done()):
            raise EngineDeadError(f"the engine loop is dead: {self.dead_error}")
        if not self._accepting:
            raise EngineDeadError("the engine is not accepting requests (starting or shutting down)")
        core = self._core
        parsed = parse_prompt(prompt)
        if (parsed.images or parsed.mm_inputs is not None) and not self.accepts_images:
            raise InvalidRequestError(
                "multi_modal_data: the served model is a text-only model and takes no images.", param="multi_modal_data"
            )
        if parsed.images:  # the processor must not run on the event loop: ``generate`` and the API run it first
            raise InvalidRequestError(
                "multi_modal_data: add_request takes images processed by `await engine.process_prompt(prompt)`; "
                "generate() does that itself.",
                param="multi_modal_data",
            )
        if parsed.mm_inputs is not None and params.truncate_prompt_tokens is not None:
            raise InvalidRequestError("truncate_prompt_tokens cannot cut a prompt that holds images.",
                                      param="truncate_prompt_tokens")  # fmt: skip
        prompt_text = parsed.text
        if parsed.token_ids is not None:
            token_ids = parsed.token_ids
        else:
            token_ids = self.encode(prompt_text, add_special_tokens) if prompt_text else []
        if request_id is not None and self._in_flight(request_id):
            raise InvalidRequestError(f"Request id {request_id!r} is already in flight.", param="request_id")
        registry = core.lora
        if lora_request is not None and registry is None:
            raise InvalidRequestError("LoRA adapters are not enabled (start with --enable-lora).", param="model")
        if parsed.mm_inputs is not None:
            core.backend.validate_images(parsed.mm_inputs)
        request = core.make_request(token_ids, params, request_id, priority=priority)
        request.mm_inputs = parsed.mm_inputs
        stream = RequestStream(self, request.request_id, params.output_kind is OutputKind.DELTA)
        self._streams[request.request_id] = stream
        if lora_request is None:
            core.add_request(request, prompt_text)
        else:
            assert registry is not None
            name = lora_request.lora_name
            if registry.requests.get(name) == lora_request and registry.is_loaded(name):
                request.lora = registry.resolve(name)  # in host memory: no I/O
                core.add_request(request, prompt_text)
            else:
                task = asyncio.create_task(self._add_after_lora_load(request, prompt_text, lora_request, stream))
                self._lora_loads.add(task)
                task.add_done_callback(self._lora_loads.discard)
        self._wakeup.set()
        return stream

    async def _add_after_lora_load(
        self, request: Request, prompt: str | None, lora_request: LoRARequest, stream: RequestStream
    ) -> None:
        registry = self._core.lora
        assert registry is not None
        try:
            request.lora = await asyncio.to_thread(registry.ensure, lora_request)
        except Exception as exc:  # the adapter's files went bad since it was registered: this request only
            if self._streams.pop(request.request_id, None) is not None:
                stream.put(exc)
            return
        if request.request_id in self._streams:  # not aborted while its adapter loaded
            self._core.add_request(request, prompt)
            self._wakeup.set()

    # -- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) -------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Register and load an adapter (in a worker thread); LoRAAdapterError if it cannot be served."""
        registry = self._core.lora
        if registry is None:
            raise InvalidRequestError("LoRA adapters are not enabled (start with --enable-lora).", param="lora_name")
        await asyncio.to_thread(registry.load, lora_request)

    async def remove_lora(self, lora_name: str) -> None:
        """Unregister an adapter. Requests already admitted with it run to the end on its buffers; LoRANotFound
        for an unknown name."""
        registry = self._core.lora
        if registry is None:
            raise InvalidRequestError("LoRA adapters are not enabled (start with --enable-lora).", param="lora_name")
        removed = registry.unload(lora_name)
        loop = asyncio.get_running_loop()
        # In the model thread, between steps: the backend's buffer bookkeeping is that thread's.
        await loop.run_in_executor(self._executor, self._core.backend.drop_lora, removed.lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        registry = self.core.lora if self.core is not None else None
        return [] if registry is None else list(registry.requests.values())

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's ``AsyncLLM.generate``: ``priority`` (keyword) needs ``scheduling_policy="priority"``; lower
        is served first."""
        params = params or SamplingParams()
        if not 1 <= params.n <= MAX_CHOICES:
            raise InvalidRequestError(f"n must be in [1, {MAX_CHOICES}], got {params.n}.", param="n")
        await self.prepare(params)
        prompt = await self.process_prompt(prompt, add_special_tokens)
        if params.n > 1:  # one engine request per choice (the core runs single sequences), merged
            base = request_id or uuid.uuid4().hex
            if self._in_flight(base):  # its choices' ids are checked as they are added
                raise InvalidRequestError(f"Request id {base!r} is already in flight.", param="request_id")
            streams: list[RequestStream] = []
            self._choice_ids[base] = [f"{base}-{i}" for i in range(params.n)]
            try:
                try:
                    for i, child in enumerate(child_params(params)):
                        streams.append(self.add_request(prompt, child, f"{base}-{i}", add_special_tokens,
                                                        lora_request, priority))  # fmt: skip
                except BaseException:
                    abort_all(streams)
                    raise
                parent = ParentOutputs(base, params.n, params.output_kind)
                async for i, out in merge(streams):  # aborts every choice however it ends
                    folded = parent.update(i, out)
                    if folded is not None:
                        yield folded
            finally:
                self._choice_ids.pop(base, None)
            return
        stream = self.add_request(prompt, params, request_id, add_special_tokens, lora_request, priority)
        try:
            async for out in stream:
                yield out
        finally:  # a consumer that stops early (break, cancel, disconnect) aborts the request
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Idempotent; unknown ids are ignored. The slot is freed before the next step. The id ``generate`` was
        given for an n > 1 request aborts all its choices (as vLLM's parent id does)."""
        for choice_id in self._choice_ids.get(request_id, ()):
            self.abort(choice_id)
        stream = self._streams.pop(request_id, None)
        if stream is None or self.core is None:
            return
        # A consumer still waiting on the stream (e.g. during shutdown) gets a final "abort" output.
        out = self.core.outputs.finish_without_output(request_id, "abort")
        if out is not None:
            self.core.record_outputs([out])
            stream.put(out)
        self.core.abort_before_next_step([request_id])
        self._wakeup.set()

    def abort_all(self) -> None:
        """Abort every request in flight (a drain cut short: the server's second Ctrl-C)."""
        for request_id in list(self._streams):
            self.abort(request_id)

    def _in_flight(self, request_id: str) -> bool:
        """Whether an id names a request or an n > 1 request's choice in flight: an id may name only one, or
        an abort of it would end the others too."""
        return request_id in self._streams or request_id in self._choice_ids

    # -- the loop ----------------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)

    async def _drive(self, steps: Driven[T]) -> T:
        """Run EngineCore's step order here: its worker calls in the model thread, without blocking the loop."""
        loop = asyncio.get_running_loop()
        value: Any = None
        error: Exception | None = None
        while True:
            try:
                op = steps.throw(error) if error is not None else steps.send(value)
            except StopIteration as stop:
                return stop.value
            value = error = None
            if isinstance(op, RunInWorker):
                if op.forward:
                    self._forward_started, self._forward_has_started = None, False
                value = loop.run_in_executor(self._executor, op.fn, *op.args)
                if op.forward:
                    self._forward = value
            elif isinstance(op, AwaitResult):
                try:
                    value = await op.handle
                except Exception as failure:  # the order decides what a failed call means
                    error = failure
            elif isinstance(op, AwaitForwardStarted):
                await self._until_forward_started(op.handle)

    def _on_forward_started(self, loop: asyncio.AbstractEventLoop) -> None:
        """The backend's forward_started, in the worker thread."""
        self._forward_has_started = True
        waiter = self._forward_started
        if waiter is not None:
            loop.call_soon_threadsafe(self._mark_forward_started, waiter)

    def _mark_forward_started(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    async def _until_forward_started(self, forward: asyncio.Future[Any]) -> None:
        """Wait, idle (the GIL free), until the worker thread has set up the step and entered the model's
        compute (or the step ended: a backend need not say). Measured served (medians): with this thread's
        output processing and stream writes running from the launch on, the worker took 0.54 ms to start the
        step and 0.68 ms to set it up; with this wait, 0.07 and 0.53 ms."""
        if self._forward_has_started:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._forward_started = waiter
        if not self._forward_has_started:
            await asyncio.wait((waiter, forward), return_when=asyncio.FIRST_COMPLETED)

    async def _run_loop(self) -> None:
        core = self._core
        step: InFlightStep | None = None
        try:
            while True:
                if step is None:
                    step = await self._drive(core.launch())
                if step is None:
                    if core.has_unfinished:  # scheduled nothing (e.g. every slot waits on a cap)
                        await asyncio.sleep(0.001)
                    elif self._stopping:
                        return
                    else:
                        self._wakeup.clear()
                        await self._wakeup.wait()
                    continue
                # Step n's outputs come back with step n + 1 already computing (see EngineCore.complete),
                # unless that forward would take every core: then they are made, delivered and sent first.
                overlap = not core.backend.forward_fills_host_cpus()
                outputs, step = await self._drive(core.complete(step, overlap=overlap))
                self._deliver(outputs)
                self._maybe_log(core)
                if step is None:
                    # The handlers run (frames, socket writes) before the next launch or before the loop idles.
                    await asyncio.sleep(0)
        except BaseException as error:
            forward = self._forward
            if forward is not None and not forward.done():  # let a forward in flight finish before failing
                with contextlib.suppress(BaseException):
                    await asyncio.shield(forward)
            if not isinstance(error, asyncio.CancelledError):
                logger.exception("engine loop died")
                self.dead_error = error
            self._fail_all(core, error)
            raise

    def _fail_all(self, core: EngineCore, error: BaseException) -> None:
        message = f"engine loop died: {type(error).__name__}: {error}"
        self.dead_error = self.dead_error or error
        ids = list(self._streams)
        with contextlib.suppress(Exception):
            self._deliver(core.fail_requests(ids, message))
        for request_id in ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(EngineDeadError(message))

    def _maybe_log(self, core: EngineCore) -> None:
        if self.config.disable_log_stats:  # --disable-log-stats
            return
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < _LOG_INTERVAL_S:
            return
        prompt, gen = core.prompt_tokens_total, core.generation_tokens_total
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV slots used: %.1f%%",
            (prompt - self._last_log_tokens[0]) / elapsed, (gen - self._last_log_tokens[1]) / elapsed,
            len(core.scheduler.running), len(core.scheduler.waiting), 100 * core.kv_cache_usage,
        )
        self._last_log = now
        self._last_log_tokens = (prompt, gen)
