"""EngineCore: the step order and its failure handling, once, for both drivers.

A step is: schedule, execute (the backend's forward and sampling), update (the scheduler's bookkeeping),
propose (drafts for the next step), emit (detokenize, stop strings, RequestOutputs). ``launch`` and
``complete`` write that order as generators of ``WorkerOp``s: wherever the order needs the worker thread
(execute, propose) it yields, and its driver runs the call there. ``EngineCore.step()`` drives them inline,
one step at a time; AsyncEngine drives the same generators with the worker thread and overlap: step n + 1
is scheduled and its forward started before step n's outputs are emitted (unless a stop string may end a
request in step n's text, when emit must come first).

Failure handling lives here too: a failed backend step ends only that step's requests, and after
``MAX_CONSECUTIVE_STEP_FAILURES`` in a row the next ``launch`` raises EngineDeadError.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.base import Backend
from nxdserve.engine.metrics import EngineMetrics
from nxdserve.engine.output_processor import OutputProcessor
from nxdserve.engine.outputs import RequestOutput
from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.request import Request, RequestStatus
from nxdserve.engine.step import RequestUpdate, StepResult
from nxdserve.engine.structured import GrammarCompiler, StructuredOutputManager
from nxdserve.errors import (
    ConfigError,
    EngineDeadError,
    InvalidRequestError,
    LoRAAdapterError,
    QueueFullError,
    RequestTooLongError,
)
from nxdserve.lora.adapter import LoraAdapter
from nxdserve.lora.registry import LoraRegistry
from nxdserve.sampling_params import SamplingParams
from nxdserve.scheduler.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3
T = TypeVar("T")


@dataclass
class RunInWorker:
    """Start ``fn(*args)`` in the worker thread; the driver sends back a handle on the running call."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    forward: bool = False  # the step's forward: the driver may listen for the backend's forward_started


@dataclass
class AwaitResult:
    """Wait for a call started by RunInWorker; the driver sends back its result or throws its exception."""

    handle: Any


@dataclass
class AwaitForwardStarted:
    """Wait, without using the GIL, until the forward behind ``handle`` entered the model's compute (or ended)."""

    handle: Any


WorkerOp = RunInWorker | AwaitResult | AwaitForwardStarted
Driven = Generator[WorkerOp, Any, T]


@dataclass
class InFlightStep:
    """A scheduled step whose forward was started: ``forward`` is the driver's handle on it."""

    sched: SchedulerOutput
    forward: Any


@dataclass
class _Finished:
    """The inline driver's handle: the call already ran."""

    value: Any = None
    error: Exception | None = None


def run_inline(steps: Driven[T]) -> T:
    """Drive ``steps`` in this thread, each worker call run when it is started (no overlap)."""
    value: Any = None
    error: Exception | None = None
    while True:
        try:
            op = steps.throw(error) if error is not None else steps.send(value)
        except StopIteration as stop:
            return stop.value
        value = error = None
        if isinstance(op, RunInWorker):
            try:
                value = _Finished(op.fn(*op.args))
            except Exception as failure:  # re-raised where the order awaits the call
                value = _Finished(error=failure)
        elif isinstance(op, AwaitResult):
            value, error = op.handle.value, op.handle.error


class Proposer(Protocol):
    """Speculative-decoding proposer: sets ``spec_token_ids`` on running requests after each step."""

    max_spec_tokens: int

    def propose(self, requests: list[Request], batch: PersistentBatch, sched: SchedulerOutput,
                result: StepResult) -> None: ...


@dataclass
class StepTimings:
    """Seconds spent per phase, summed over steps (for the benchmark's breakdown)."""

    steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    process: float = 0.0
    propose: float = 0.0
    tokens: int = 0

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("steps", "schedule", "prepare", "forward", "sample", "process",
                                               "propose", "tokens")}


@dataclass
class StepUpdates:
    """A processed step between ``EngineCore.update`` and ``EngineCore.emit``."""

    updates: list[RequestUpdate]
    result: StepResult

    @property
    def may_stop_on_text(self) -> bool:
        """Whether a stop string may end a request in this step's new text. Only then must ``emit`` run
        before the next step is scheduled: otherwise nothing it does changes what the scheduler sees."""
        return any(u.new_token_ids and u.request.params.stop and not u.finished for u in self.updates)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_slots_used: int
    num_slots: int
    kv_cache_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    num_finished_total: int
    timings: dict[str, float] = field(default_factory=dict)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        backend: Backend,
        tokenizer: Any,
        metrics: EngineMetrics | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        assert config.max_model_len is not None, "resolve the config first"
        self.config = config
        self.backend = backend
        self.tokenizer = tokenizer
        caps = backend.capabilities
        self.capabilities = caps
        self.max_model_len = min(config.max_model_len, caps.max_model_len)
        self.max_prompt_len = min(self.max_model_len - 1, caps.max_prompt_len)
        self.vocab_size = caps.vocab_size
        eos = set(caps.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.proposer = proposer
        max_spec = proposer.max_spec_tokens if proposer is not None else config.num_speculative_tokens
        self.num_slots = min(config.max_num_seqs, caps.max_num_seqs)
        backend.bind(self.num_slots, self.max_model_len, max_spec)  # the backend creates and owns the batch
        self.scheduler = Scheduler(config, caps)
        self.lora: LoraRegistry | None = None  # adapters served (--enable-lora)
        if config.enable_lora:
            spec = backend.lora_model_spec()
            try:
                self.lora = LoraRegistry(
                    spec, config.max_loras, config.max_lora_rank, config.max_cpu_loras, check=backend.check_lora
                )
            except LoRAAdapterError as exc:  # a start-up setting, not a request's fault
                raise ConfigError(exc.message) from exc
        self.outputs = OutputProcessor(tokenizer)
        # Structured outputs (nxdserve.engine.structured): grammars compile on first use, per request.
        self.structured = StructuredOutputManager(GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids))
        self.metrics = metrics
        self.timings = StepTimings()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_finished_total = 0
        self.consecutive_failures = 0
        self._last_failure: BaseException | None = None
        self._deferred_aborts: list[str] = []

    # -- admission ---------------------------------------------------------------------------------
    def make_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora: LoraAdapter | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate everything that can be known before the request runs; raise a typed error. ``lora``: the
        adapter's host weights (``self.lora.resolve(name)``); ``priority``: lower is served first, only under
        ``scheduling_policy="priority"`` (vLLM refuses a non-zero one under fcfs too)."""
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"Got priority {priority} but priority scheduling is not enabled (start with "
                "--scheduling-policy priority).", param="priority",
            )
        if lora is not None and self.lora is None:
            raise InvalidRequestError("LoRA adapters are not enabled (start with --enable-lora).", param="model")
        if params.n != 1:  # AsyncEngine.generate and the API start one request per choice (engine/choices.py)
            raise InvalidRequestError(
                f"A single engine request runs one sequence, got n={params.n}: use AsyncEngine.generate, which "
                "starts one request per choice, or add n requests.", param="n",
            )
        if request_id is None:
            request_id = uuid.uuid4().hex
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"Request id {request_id!r} is already in flight.", param="request_id")
        params.validate(self.vocab_size, self.config.max_logprobs)
        self.backend.validate_request(params)
        if params.structured_outputs is not None:  # cached when AsyncEngine.prepare compiled it off the loop
            self.structured.compiler.compile(params.structured_outputs)
        if params.truncate_prompt_tokens is not None:  # vLLM: keep the last k tokens; -1: max_model_len
            if params.truncate_prompt_tokens > self.max_model_len:
                raise InvalidRequestError(
                    f"truncate_prompt_tokens value ({params.truncate_prompt_tokens}) is greater than max_model_len "
                    f"({self.max_model_len}). Please, select a smaller truncation size.",
                    param="truncate_prompt_tokens",
                )
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            prompt_token_ids = prompt_token_ids[len(prompt_token_ids) - keep:] if keep else []
        if not prompt_token_ids:
            raise InvalidRequestError(
                "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"Token id {bad[0]} is out of vocabulary (the model's vocabulary size is {self.vocab_size}).",
                param="prompt",
            )
        num_prompt = len(prompt_token_ids)
        if num_prompt > self.max_prompt_len:
            raise RequestTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains {num_prompt} input tokens, and the longest prompt this deployment accepts is "
                f"{self.max_prompt_len} tokens (room must remain for at least one output token). Please reduce "
                "the length of the input prompt.",
                param="prompt",
            )
        if params.max_tokens is None:
            max_tokens = self.max_model_len - num_prompt
        else:
            max_tokens = params.max_tokens
            if num_prompt + max_tokens > self.max_model_len:
                raise RequestTooLongError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                    f"requested {max_tokens} output tokens and your prompt contains at least {num_prompt} input "
                    f"tokens, for a total of at least {num_prompt + max_tokens} tokens. Please reduce the length "
                    "of the input prompt or the number of requested output tokens.",
                    param="max_tokens",
                )
        if params.min_tokens > max_tokens:  # vLLM's check, once max_tokens is known
            raise InvalidRequestError(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {params.min_tokens}.",
                param="min_tokens",
            )
        if self.config.max_waiting is not None and len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"The waiting queue is full ({self.config.max_waiting} requests); retry later."
            )
        request = Request(request_id, list(prompt_token_ids), params, max_tokens, self.eos_token_ids,
                          priority=priority)
        request.lora = lora
        return request

    def add_request(self, request: Request, prompt: str | None = None) -> None:
        self.outputs.add_request(request, prompt)
        self.structured.add(request)
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish the requests; their slots go back to the scheduler, and to the backend's batch with the next
        plan. Not while a step's update is pending (the async engine defers aborts: ``abort_before_next_step``)."""
        finished = self.scheduler.finish_requests(request_ids, status)
        self.structured.remove(request_ids)
        self.num_finished_total += len(finished)
        if finished and self.metrics is not None:  # keep gauges true when the engine goes idle after aborts
            self.metrics.record_step(len(self.scheduler.running), len(self.scheduler.waiting),
                                     self.kv_cache_usage, 0, 0)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step order -----------------------------------------------------------------------------
    def launch(self) -> Driven[InFlightStep | None]:
        """Apply deferred aborts, schedule the next step and start its forward in the worker thread. None:
        nothing to run now. Raises EngineDeadError after too many consecutive failed steps."""
        if self.consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineDeadError(
                f"{self.consecutive_failures} consecutive steps failed; last: {self._last_failure}"
            ) from self._last_failure
        if self._deferred_aborts:
            ids, self._deferred_aborts = self._deferred_aborts, []
            self.abort(ids)  # the callers already stopped listening; outputs are dropped
        if not self.has_unfinished:
            return None
        sched = self.schedule()
        if sched.is_empty:
            return None
        forward = yield RunInWorker(self.execute, (sched,), forward=True)
        return InFlightStep(sched, forward)

    def complete(self, step: InFlightStep, overlap: bool) -> Driven[tuple[list[RequestOutput], InFlightStep | None]]:
        """Finish ``step``: its result (or failure), update, drafts for the next step, its outputs. With
        ``overlap`` the next step is launched before the outputs are made, and returned with them."""
        try:
            result = yield AwaitResult(step.forward)
        except Exception as error:  # a backend failure ends only this step's requests
            self.consecutive_failures += 1
            self._last_failure = error
            return self.fail_step(step.sched, error), None
        self.consecutive_failures = 0
        processed = self.update(step.sched, result)
        # Scheduling (and drafting) needs only update()'s bookkeeping, unless a stop string may end a request
        # in this step's text: then the outputs are made first. Otherwise detokenization and the handlers' work
        # (JSON, SSE writes: ~3 ms a step at 32 streams) run while the worker thread computes the next step.
        outputs = self.emit(processed) if not overlap or processed.may_stop_on_text else None
        if self.proposer is not None:
            yield AwaitResult((yield RunInWorker(self.propose, (step.sched, result))))
        following = None
        if overlap:
            following = yield from self.launch()
            if following is not None and self.backend.reports_forward_start:
                yield AwaitForwardStarted(following.forward)
        return (outputs if outputs is not None else self.emit(processed)), following

    def abort_before_next_step(self, request_ids: list[str]) -> None:
        """Abort when the next step is launched (the async engine: a step may be in flight now)."""
        self._deferred_aborts.extend(request_ids)

    # -- the phases ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        preempted_before = self.scheduler.num_preemptions_total
        sched = self.scheduler.schedule()
        self.timings.schedule += time.perf_counter() - t0
        if self.metrics is not None and self.scheduler.num_preemptions_total != preempted_before:
            self.metrics.record_preemptions(self.scheduler.num_preemptions_total - preempted_before)
        return sched

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """The model forward and sampling. Runs in the worker thread under AsyncEngine."""
        if self.structured.active:  # structured outputs: the constrained rows' token mask
            sched.plan = dataclasses.replace(sched.plan, token_mask=self.structured.fill(sched.plan, sched.requests))
        return self.backend.execute(sched.plan)

    def update(self, sched: SchedulerOutput, result: StepResult) -> StepUpdates:
        """The scheduler's half of processing a step: tokens appended, length/EOS finishes, slots freed,
        counters and metrics. Enough to schedule the next step; ``emit`` makes the outputs."""
        t0 = time.perf_counter()
        updates = self.scheduler.update_from_output(sched, result)
        if self.structured.active:  # structured outputs: matchers consume the accepted tokens
            self.structured.advance(updates)
        num_generated = sum(len(u.new_token_ids) for u in updates)
        self.num_finished_total += sum(1 for u in updates if u.finished)
        self._record_spec(updates, result)
        tm = self.timings
        tm.steps += 1
        tm.tokens += sched.plan.total_tokens
        tm.prepare += result.timings.get("prepare", 0.0)
        tm.forward += result.timings.get("forward", 0.0)
        tm.sample += result.timings.get("sample", 0.0)
        self.prompt_tokens_total += sched.num_prefill_tokens
        self.generation_tokens_total += num_generated
        if self.metrics is not None:
            self.metrics.record_step(
                len(self.scheduler.running), len(self.scheduler.waiting), self.kv_cache_usage,
                num_generated, sched.plan.total_tokens,
            )
            if sched.num_prefix_queried_tokens:
                self.metrics.record_prefix_cache(sched.num_prefix_queried_tokens, sched.num_prefix_cached_tokens)
            if self.lora is not None:
                self.metrics.record_lora(*self.scheduler.adapter_names(), self.lora.max_loras)
        tm.process += time.perf_counter() - t0
        return StepUpdates(updates, result)

    def emit(self, step: StepUpdates) -> list[RequestOutput]:
        """The outputs' half: detokenize, stop strings (which finish their requests here), RequestOutputs."""
        t0 = time.perf_counter()
        outputs, stopped = self.outputs.process(step.updates, step.result)
        if stopped:
            self.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.record_outputs(outputs)
        self.timings.process += time.perf_counter() - t0
        return outputs

    def propose(self, sched: SchedulerOutput, result: StepResult) -> None:
        """Draft tokens for the next step, from the backend's batch (which holds this step's tokens now).
        Model compute: runs in the worker thread."""
        if self.proposer is None:
            return
        t0 = time.perf_counter()
        batch = self.backend.batch
        assert batch is not None
        self.proposer.propose(self.scheduler.running, batch, sched, result)
        self.timings.propose += time.perf_counter() - t0

    def _record_spec(self, updates: list[Any], result: StepResult) -> None:
        if self.metrics is None:
            return
        if result.draft_alternatives is not None:
            self.metrics.record_alternatives(*result.draft_alternatives)
        fused = result.fused_spec  # the NxD backend verifies drafts on device
        if fused is not None:
            drafts = [(fused.num_drafts, int(a)) for a in fused.accepted_drafts if a >= 0]
        else:
            drafts = [(u.num_drafts, u.num_accepted_drafts) for u in updates if u.num_drafts > 0]
        if not drafts:
            return
        per_pos = [0] * max(n for n, _ in drafts)
        for _, accepted_count in drafts:
            for pos in range(accepted_count):
                per_pos[pos] += 1
        self.metrics.record_spec(len(drafts), sum(n for n, _ in drafts), per_pos)

    def fail_step(self, sched: SchedulerOutput, error: BaseException) -> list[RequestOutput]:
        """The backend raised: finish the step's requests with an error, keep serving the rest."""
        message = f"{type(error).__name__}: {error}"
        logger.error("step failed for %d requests: %s", len(sched.requests), message, exc_info=error)
        ids = [r.request_id for r in sched.requests if not r.status.is_finished]
        return self.fail_requests(ids, message)

    def fail_requests(self, request_ids: list[str], message: str) -> list[RequestOutput]:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        outputs = []
        for request_id in request_ids:
            out = self.outputs.finish_without_output(request_id, "error", message)
            if out is not None:
                outputs.append(out)
        self.record_outputs(outputs)
        return outputs

    def record_outputs(self, outputs: list[RequestOutput]) -> None:
        if self.metrics is not None:
            now = time.monotonic()
            for out in outputs:
                self.metrics.record_output(out, now)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort now (between steps). Returns final "abort" outputs for requests still tracked."""
        outputs = []
        for request_id in request_ids:
            out = self.outputs.finish_without_output(request_id, "abort")
            if out is not None:
                outputs.append(out)
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.record_outputs(outputs)
        return outputs

    def step(self) -> list[RequestOutput]:
        """One step, run inline without overlap: the order the async engine pipelines."""
        step = run_inline(self.launch())
        if step is None:
            return []
        outputs, _ = run_inline(self.complete(step, overlap=False))
        return outputs

    # -- introspection -----------------------------------------------------------------------------
    @property
    def kv_cache_usage(self) -> float:
        """KV is reserved per slot at admission, so usage is the fraction of slots taken."""
        return len(self.scheduler.running) / self.num_slots

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_slots_used=len(self.scheduler.running),
            num_slots=self.num_slots,
            kv_cache_usage=self.kv_cache_usage,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_finished_total=self.num_finished_total,
            timings=self.timings.as_dict(),
        )
