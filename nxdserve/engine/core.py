"""EngineCore: schedule -> backend.execute -> update, with the whole loop readable in ``step()``.

The core is synchronous and single-threaded. AsyncEngine drives the same three phases but runs
``execute`` in a worker thread so the event loop keeps serving HTTP while the model computes.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.base import Backend, StepResult
from nxdserve.engine.metrics import EngineMetrics
from nxdserve.engine.output_processor import OutputProcessor
from nxdserve.engine.outputs import RequestOutput
from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.request import Request, RequestStatus
from nxdserve.engine.structured import GrammarCompiler, StructuredOutputManager
from nxdserve.errors import InvalidRequestError, QueueFullError, RequestTooLongError
from nxdserve.sampling_params import SamplingParams
from nxdserve.scheduler.scheduler import RequestUpdate, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)


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
        self.batch = PersistentBatch(min(config.max_num_seqs, caps.max_num_seqs), self.max_model_len, max_spec)
        backend.bind(self.batch)
        self.scheduler = Scheduler(config, caps, self.batch)
        self.outputs = OutputProcessor(tokenizer)
        # Structured outputs (nxdserve.engine.structured): grammars compile on first use, per request.
        self.structured = StructuredOutputManager(GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids))
        self.metrics = metrics
        self.timings = StepTimings()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_finished_total = 0

    # -- admission ---------------------------------------------------------------------------------
    def make_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """Validate everything that can be known before the request runs; raise a typed error."""
        if request_id is None:
            request_id = uuid.uuid4().hex
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"Request id {request_id!r} is already in flight.", param="request_id")
        params.validate(self.vocab_size, self.config.max_logprobs)
        self.backend.validate_request(params)
        if params.structured_outputs is not None:  # cached when AsyncEngine.prepare compiled it off the loop
            self.structured.compiler.compile(params.structured_outputs)
        if params.truncate_prompt_tokens is not None:  # vLLM: keep the last k tokens; -1: max_model_len
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
        if self.config.max_waiting is not None and len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"The waiting queue is full ({self.config.max_waiting} requests); retry later."
            )
        return Request(request_id, list(prompt_token_ids), params, max_tokens, self.eos_token_ids)

    def add_request(self, request: Request, prompt: str | None = None) -> None:
        self.outputs.add_request(request, prompt)
        self.structured.add(request)
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Free the requests' slots. Only call between steps (the backend reads the batch arrays)."""
        finished = self.scheduler.finish_requests(request_ids, status)
        self.structured.remove(request_ids)
        self.num_finished_total += len(finished)
        if finished and self.metrics is not None:  # keep gauges true when the engine goes idle after aborts
            self.metrics.record_step(len(self.scheduler.running), len(self.scheduler.waiting),
                                     self.kv_cache_usage, 0, 0, 0)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- one step, in three phases ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.timings.schedule += time.perf_counter() - t0
        return sched

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """The model forward and sampling. Runs in the worker thread under AsyncEngine."""
        if self.structured.active:  # structured outputs: the constrained rows' token mask
            sched.plan.token_mask = self.structured.fill(sched.plan, sched.requests)
        return self.backend.execute(sched.plan)

    def process(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        return self.emit(self.update(sched, result))

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
                sched.num_prefill_tokens, num_generated, sched.plan.total_tokens,
            )
            if sched.num_prefix_queried_tokens:
                self.metrics.record_prefix_cache(sched.num_prefix_queried_tokens, sched.num_prefix_cached_tokens)
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
        """Draft tokens for the next step. Model compute: runs in the worker thread under AsyncEngine."""
        if self.proposer is None:
            return
        t0 = time.perf_counter()
        self.proposer.propose(self.scheduler.running, self.batch, sched, result)
        self.timings.propose += time.perf_counter() - t0

    def _record_spec(self, updates: list[Any], result: StepResult) -> None:
        if self.metrics is None:
            return
        alternatives = result.aux.get("draft_alternatives")
        if alternatives is not None:
            self.metrics.record_alternatives(*alternatives)
        fused = result.aux.get("fused_accepted_drafts")  # the NxD backend verifies drafts on device
        if fused is not None:
            accepted = [int(a) for a in fused if a >= 0]
            width = int(result.aux.get("fused_num_drafts", 0))
            drafts = [(width, a) for a in accepted]
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
        sched = self.schedule()
        if sched.is_empty:
            return []
        try:
            result = self.execute(sched)
        except Exception as error:  # a backend failure ends only this step's requests
            return self.fail_step(sched, error)
        outputs = self.process(sched, result)
        self.propose(sched, result)
        return outputs

    # -- introspection -----------------------------------------------------------------------------
    @property
    def kv_cache_usage(self) -> float:
        """KV is reserved per slot at admission, so usage is the fraction of slots taken."""
        return len(self.scheduler.running) / self.batch.max_num_seqs

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_slots_used=len(self.scheduler.running),
            num_slots=self.batch.max_num_seqs,
            kv_cache_usage=self.kv_cache_usage,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_finished_total=self.num_finished_total,
            timings=self.timings.as_dict(),
        )
