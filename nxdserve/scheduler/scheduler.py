"""The scheduler: vLLM V1's one rule with two policies.

Every request has ``num_computed_tokens`` (tokens whose KV is in its slot) and
``num_tokens_with_spec`` (prompt + output + drafts). Each step hands out tokens so that the first
catches up with the second, running requests first, then waiting ones, under
``max_num_batched_tokens`` and ``max_num_seqs``, and never past ``max_model_len - 1``. Prefill,
chunked prefill, decode and speculative verification are all this rule; the two policies only
differ in how a step may mix them:

- chunked: a prompt may be split to fit the budget left after the running requests, so a step
  mixes decodes with prefill chunks; at most ``max_num_partial_prefills`` prompts are mid-prefill
  at once (enforced, unlike vLLM), and ``long_prefill_token_threshold`` caps one request's chunk. A
  waiting prompt that fits one step's budget is not split: it runs whole even past the budget, by up to
  ``whole_prompt_overflow`` tokens (on by default only with the CPU default budget).
- prefill-first: prompts are never split and a step is all-prefill or all-decode; a prefill step
  runs when a slot is free and the head prompt fits, but never more than
  ``max_consecutive_prefill_steps`` in a row while decodes wait (anti-starvation).

Slots are whole KV lines, reserved at admission, so a running request never runs out of KV and fcfs never
preempts. The scheduler never touches the backend's persistent batch: each plan carries what changed since
the previous one (freed slots, new requests, drafts; see nxdserve/engine/step.py), and a finish or abort
between steps only records its freed slot for the next plan.

Priority scheduling (``scheduling_policy="priority"``, nxdserve.scheduler.policy): the waiting queue is sorted
by (priority, arrival), and preemption happens at admission, the one place here where a request can lack KV:
when the head of the queue would be admitted now but every slot is taken, the running request with the
worst (priority, arrival) gives its slot up, if that is worse than the head's. vLLM preempts the same victim,
but only when a running request's next KV block cannot be allocated (a waiting request never preempts
there); with a slot per request that never happens, so slot exhaustion is the trigger. The victim keeps its
output tokens, goes back to the waiting queue by its key, and resumes by recomputing prompt and output (as
vLLM V1 does; with prefix caching its old line is reused if still free). Not victims: requests admitted in
this plan, ones too long to recompute as one prompt (``max_prompt_len``), and ones still computing a prompt
whose prompt logprobs were requested (already sent in part).

Prefix caching (``enable_prefix_caching``, where prompts may start mid-slot): a freed slot remembers the
tokens whose KV its line still holds, and a waiting prompt takes the free slot that shares the longest
prefix with it and starts computing after that prefix (at least its last prompt token runs, for its
logits). Nothing is copied: a repeated system prompt or the next turn of a conversation finds its KV where
the previous request left it, while the slot is free. A prompt that matches nothing takes a slot that holds
nothing, else the one freed longest ago.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass

import numpy as np

from nxdserve.config import EngineConfig
from nxdserve.engine.request import Request, RequestStatus
from nxdserve.engine.step import BackendCapabilities, NewRequest, RequestUpdate, StepPlan, StepResult
from nxdserve.scheduler.policy import WaitingQueue, priority_key

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    plan: StepPlan
    requests: list[Request]  # aligned with the plan's rows
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Prefix caching: prompt tokens of the requests admitted in this step, and those their slots held.
    num_prefix_queried_tokens: int = 0
    num_prefix_cached_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: EngineConfig, caps: BackendCapabilities) -> None:
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        self.max_model_len = config.max_model_len
        self.max_num_seqs = min(config.max_num_seqs, caps.max_num_seqs)
        self.token_budget = config.max_num_batched_tokens
        self.chunked = config.enable_chunked_prefill and caps.chunked_prefill and caps.mixed_prefill_decode
        if not self.chunked and self.token_budget < self.max_model_len:
            # Prefill-first never splits a prompt, so any prompt must fit one step's budget.
            self.token_budget = self.max_model_len
        if config.enable_chunked_prefill and not self.chunked:
            logger.warning(
                "chunked prefill requested but the backend cannot split prompts or mix prefill and decode "
                "rows in one forward: scheduling prefill-first (token budget %d)", self.token_budget
            )
        self.long_prefill_threshold = config.long_prefill_token_threshold
        self.max_partial_prefills = config.max_num_partial_prefills
        self.whole_prompt_overflow = (config.whole_prompt_overflow or 0) if self.chunked else 0
        self.max_consecutive_prefills = config.max_consecutive_prefill_steps
        self.max_prefills_per_step = caps.max_prefills_per_step
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.by_priority = self.waiting.by_priority
        # Longest request a preemption may leave to recompute: it comes back as one prompt.
        self.max_recompute_len = caps.max_prompt_len if caps.resume_by_recompute else 0
        self.num_preemptions_total = 0
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._free_slots = list(range(self.max_num_seqs))  # a heap: lowest slot first keeps lines dense
        # Speculative proposers keep KV of their own per slot (the EAGLE head's, a draft model's), which a
        # reused prefix would not match; prompt logprobs need every prompt position computed.
        self.prefix_caching = config.enable_prefix_caching and caps.chunked_prefill and not config.speculative_config
        if config.enable_prefix_caching and not self.prefix_caching:
            logger.warning(
                "prefix caching requested but %s: every prompt is computed from its first token",
                "speculative proposers keep KV of their own" if caps.chunked_prefill
                else "the backend cannot start a prompt mid-slot",
            )
        self._resident: dict[int, np.ndarray] = {}  # free slot -> the tokens whose KV its line still holds
        self._resident_lora: dict[int, str | None] = {}  # free slot -> the adapter that KV was computed with
        # LoRA: at most this many distinct adapters among running requests (the forward's buffer slots).
        self.max_loras = config.max_loras if config.enable_lora else 0
        self._freed_at: dict[int, int] = {}  # free slot -> when it was freed (a counter), for the choice above
        self._frees = 0
        self._queried_since_plan = 0
        self._cached_since_plan = 0
        self._freed_since_plan: list[int] = []
        self._new_since_plan: list[NewRequest] = []
        self._preempted_since_plan: list[int] = []  # slots among _freed_since_plan that a preemption freed
        self._discarded_since_plan: list[str] = []  # preempted requests that finished while waiting
        self._consecutive_prefill_steps = 0

    # -- requests in and out -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, stop-string, error) requests; unknown or finished ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            if request.status == RequestStatus.WAITING:
                self.waiting.remove(request)
                if request.num_preemptions:
                    self._discarded_since_plan.append(request.request_id)
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    def _free(self, request: Request) -> None:
        if request.slot is not None:
            self.running.remove(request)
            if self.prefix_caching:
                self._remember(request)
            heapq.heappush(self._free_slots, request.slot)
            self._freed_since_plan.append(request.slot)
            request.slot = None
        request.spec_token_ids = []
        request.spec_alt_ids = []
        self.requests.pop(request.request_id, None)

    def _remember(self, request: Request) -> None:
        """What the freed slot's line holds: KV for every computed token (drafts rolled back, the last
        sampled token never fed). A failed forward may have left it half written: nothing then."""
        slot = request.slot
        assert slot is not None
        self._frees += 1
        self._freed_at[slot] = self._frees
        # Image tokens as their content hashes (Request.prefix_key_ids): other images never match them.
        held = np.concatenate((request.prefix_key_ids(), np.asarray(request.output_token_ids, dtype=np.int64)))
        held = held[: request.num_computed_tokens]
        if held.size and request.status != RequestStatus.FINISHED_ERROR:
            self._resident[slot] = held
            self._resident_lora[slot] = request.lora_name  # KV computed with an adapter is that adapter's
        else:
            self._resident.pop(slot, None)

    def _pick_slot(self, request: Request) -> tuple[int, int]:
        """(free slot, prompt tokens already in it) for a waiting request; the slot is not taken yet."""
        if not self.prefix_caching:
            return self._free_slots[0], 0
        best, best_len = -1, 0
        if request.params.prompt_logprobs is None and self._resident:
            # A resumed request's outputs are part of what it recomputes: its old line may still hold them.
            # Image tokens as their content hashes (Request.prefix_key_ids).
            tokens = np.concatenate((request.prefix_key_ids(), np.asarray(request.output_token_ids, dtype=np.int64)))
            for slot in self._free_slots:
                held = self._resident.get(slot)
                if held is not None and held[0] == tokens[0] and self._resident_lora.get(slot) == request.lora_name:
                    n = _common_prefix_len(held, tokens)
                    if n > best_len:
                        best, best_len = slot, n
        if best < 0:  # keep what other slots hold: one that holds nothing, else the longest free
            best = min(self._free_slots, key=lambda s: (s in self._resident, self._freed_at.get(s, 0), s))
        return best, min(best_len, request.num_tokens - 1)

    def adapter_names(self) -> tuple[list[str], list[str]]:
        """(running, waiting) LoRA adapters, sorted: the labels of vllm:lora_requests_info."""
        running = {r.lora_name for r in self.running if r.lora is not None}
        waiting = {r.lora_name for r in self.waiting if r.lora is not None}
        return sorted(running), sorted(waiting)  # type: ignore[arg-type]

    def _lora_fits(self, request: Request) -> bool:
        """Admitting ``request`` keeps the running adapters within ``max_loras``."""
        name = request.lora_name
        if name is None:
            return True
        running = {r.lora_name for r in self.running if r.lora is not None}
        return name in running or len(running) < self.max_loras

    def _admit(self, request: Request, slot: int, cached: int) -> None:
        if slot == self._free_slots[0]:
            slot = heapq.heappop(self._free_slots)
        else:
            self._free_slots.remove(slot)
            heapq.heapify(self._free_slots)
        self._resident.pop(slot, None)
        request.num_computed_tokens = cached
        resumed = request.num_preemptions > 0
        if not resumed:  # prefix-cache stats and num_cached_tokens describe the first admission (vLLM)
            request.num_cached_tokens = cached
            if self.prefix_caching:
                self._queried_since_plan += request.num_prompt_tokens
                self._cached_since_plan += cached
        request.slot = slot
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self._new_since_plan.append(NewRequest(
            slot, request.request_id, request.prompt_token_ids, request.params, request.stop_ids_for_min_tokens(),
            lora=request.lora, output_token_ids=list(request.output_token_ids), resumed=resumed,
            mm_inputs=request.mm_inputs,
        ))  # fmt: skip
        self.running.append(request)

    # -- priority preemption -----------------------------------------------------------------------
    @property
    def _has_room(self) -> bool:
        return bool(self._free_slots) and len(self.running) < self.max_num_seqs

    def _victim_for(self, request: Request) -> Request | None:
        """The running request to preempt so that ``request`` gets a slot: the worst by (priority, arrival)
        among those that may be preempted, if it is worse than ``request``. None under fcfs."""
        if not self.by_priority:
            return None
        admitted_now = {new.request_id for new in self._new_since_plan}
        candidates = [
            r for r in self.running
            if r.request_id not in admitted_now
            and r.num_tokens <= self.max_recompute_len
            and not (r.params.prompt_logprobs is not None and r.num_computed_tokens < r.num_prompt_tokens)
        ]  # fmt: skip
        if not candidates:
            return None
        victim = max(candidates, key=priority_key)
        return victim if priority_key(victim) > priority_key(request) else None

    def _preempt(self, victim: Request, rows: list[tuple[Request, int]]) -> int:
        """Give ``victim``'s slot up and queue it to resume; returns the tokens it had been given in this step."""
        refund = 0
        for i, (request, num_new) in enumerate(rows):
            if request is victim:
                refund = num_new
                del rows[i]
                break
        slot = victim.slot
        assert slot is not None
        self.running.remove(victim)
        if self.prefix_caching:  # its KV stays in the line until another request takes it
            self._remember(victim)
        heapq.heappush(self._free_slots, slot)
        self._freed_since_plan.append(slot)
        self._preempted_since_plan.append(slot)
        victim.slot = None
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.spec_alt_ids = []
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add(victim)
        logger.debug("preempted %s (priority %d) from slot %d", victim.request_id, victim.priority, slot)
        return refund

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    # -- the rule ----------------------------------------------------------------------------------
    def _tokens_to_run(self, request: Request, budget: int, computed: int | None = None) -> int:
        """``computed``: the request's computed tokens if not ``num_computed_tokens`` (a waiting prompt's cached
        prefix, before it is admitted)."""
        if computed is None:
            computed = request.num_computed_tokens
        num_new = request.num_tokens_with_spec - computed
        if 0 < self.long_prefill_threshold < num_new:
            num_new = self.long_prefill_threshold
        # The token at max_model_len - 1 is never fed back, so no position at or past it gets KV.
        return max(0, min(num_new, budget, self.max_model_len - 1 - computed))

    def schedule(self) -> SchedulerOutput:
        rows: list[tuple[Request, int]] = []
        if self.chunked:
            self._schedule_chunked(rows)
        else:
            self._schedule_prefill_first(rows)
        return self._build_output(rows)

    def _schedule_running(self, rows: list[tuple[Request, int]], budget: int) -> int:
        for request in self.running:
            if budget <= 0:
                break
            num_new = self._tokens_to_run(request, budget)
            if num_new == 0:
                continue  # like vLLM: skip, don't stop, so others still run
            rows.append((request, num_new))
            budget -= num_new
        return budget

    def _schedule_chunked(self, rows: list[tuple[Request, int]]) -> None:
        budget = self._schedule_running(rows, self.token_budget)
        scheduled = {id(r): n for r, n in rows}
        # Prompts that stay mid-prefill after this step, whether scheduled now or starved of budget.
        partial = sum(
            1 for r in self.running if r.num_computed_tokens + scheduled.get(id(r), 0) < r.num_prompt_tokens
        )
        # FCFS, except that a prompt held back only by the partial-prefill cap lets later prompts that
        # finish their prefill in this step go ahead: a long prompt never blocks short ones' TTFT.
        skipped: list[Request] = []
        # A prompt that fits one step's budget runs whole, up to whole_prompt_overflow tokens past the budget,
        # rather than being split (see config.DEFAULT_CPU_WHOLE_PROMPT_OVERFLOW).
        overflow = self.whole_prompt_overflow
        while self.waiting and budget + overflow > 0:
            if not self._has_room and not self.by_priority:
                break
            request = self.waiting.popleft()
            if not self._lora_fits(request):  # vLLM too defers it and lets later requests go ahead
                skipped.append(request)
                continue
            if not self._has_room:  # priority: a slot only by preempting a worse request
                num_new, stays_partial = self._chunk(request, budget, 0)
                if stays_partial and partial >= self.max_partial_prefills:
                    skipped.append(request)  # would not run now: preempt nothing for it
                    continue
                victim = self._victim_for(request) if num_new else None
                if victim is None:
                    self.waiting.appendleft(request)
                    break
                partial -= victim.num_computed_tokens + scheduled.get(id(victim), 0) < victim.num_prompt_tokens
                budget += self._preempt(victim, rows)
            slot, cached = self._pick_slot(request)
            num_new, stays_partial = self._chunk(request, budget, cached)
            if stays_partial and partial >= self.max_partial_prefills:
                skipped.append(request)
                continue
            if num_new == 0:
                self.waiting.appendleft(request)
                break
            self._admit(request, slot, cached)
            rows.append((request, num_new))
            budget -= num_new
            partial += stays_partial
        self.waiting.extendleft(reversed(skipped))

    def _chunk(self, request: Request, budget: int, cached: int) -> tuple[int, bool]:
        """(tokens a waiting request runs in this step, whether its prompt stays partial), chunked policy."""
        num_new = self._tokens_to_run(request, max(budget, 0), cached)
        whole = self._tokens_to_run(request, self.token_budget, cached)
        fits = whole <= budget + self.whole_prompt_overflow
        if num_new < whole and fits and whole == request.num_tokens_with_spec - cached:
            num_new = whole
        return num_new, cached + num_new < request.num_prompt_tokens

    def _schedule_prefill_first(self, rows: list[tuple[Request, int]]) -> None:
        decodes_waiting = bool(self.running)
        may_prefill = (
            self.waiting
            and (self._has_room or self.by_priority)
            and (not decodes_waiting or self._consecutive_prefill_steps < self.max_consecutive_prefills)
        )
        if may_prefill:
            budget = self.token_budget
            while self.waiting and (self._has_room or self.by_priority):
                if self.max_prefills_per_step is not None and len(rows) >= self.max_prefills_per_step:
                    break
                request = self.waiting[0]
                if not self._lora_fits(request):
                    break  # strict head-of-line, as for the token budget
                if not self._has_room:  # priority: a slot only by preempting a worse request
                    victim = self._victim_for(request) if request.num_tokens <= budget else None
                    if victim is None:
                        break
                    self._preempt(victim, rows)  # a decode-step victim: no rows in a prefill step
                slot, cached = self._pick_slot(request)
                # A resumed request recomputes its outputs too, as one prompt.
                need = request.num_tokens - cached
                if need > budget:
                    break  # never split a prompt; strict head-of-line
                self.waiting.popleft()
                self._admit(request, slot, cached)
                rows.append((request, need))
                budget -= need
            if rows:
                self._consecutive_prefill_steps = self._consecutive_prefill_steps + 1 if decodes_waiting else 0
                return
        self._consecutive_prefill_steps = 0
        self._schedule_running(rows, self.token_budget)

    def _build_output(self, rows: list[tuple[Request, int]]) -> SchedulerOutput:
        rows.sort(key=lambda row: row[0].slot)  # type: ignore[arg-type, return-value]
        n = len(rows)
        slots = np.empty(n, dtype=np.int64)
        start = np.empty(n, dtype=np.int64)
        num_scheduled = np.empty(n, dtype=np.int64)
        num_drafts = np.zeros(n, dtype=np.int64)
        sample = np.empty(n, dtype=bool)
        prefill_tokens = 0
        requests = []
        alternatives: list[tuple[int, list[int]]] = []
        drafting: list[tuple[int, list[int]]] = []
        for i, (request, num_new) in enumerate(rows):
            computed = request.num_computed_tokens
            assert request.slot is not None, "a scheduled request holds a slot"
            slots[i] = request.slot
            start[i] = computed
            num_scheduled[i] = num_new
            drafts = max(0, computed + num_new - request.num_tokens)
            if drafts != len(request.spec_token_ids):
                request.spec_token_ids = request.spec_token_ids[:drafts]
            if drafts:
                num_drafts[i] = drafts
                drafting.append((i, request.spec_token_ids))
                if request.spec_alt_ids:
                    alternatives.append((i, request.spec_alt_ids))
            request.spec_alt_ids = []  # verified with this step's drafts, or never
            sample[i] = computed + num_new >= request.num_tokens
            # Prompt tokens count once, not again when a preempted request recomputes them.
            counted_from = max(computed, request.prompt_tokens_counted)
            prompt_end = min(computed + num_new, request.num_prompt_tokens)
            if prompt_end > counted_from:
                prefill_tokens += prompt_end - counted_from
                request.prompt_tokens_counted = prompt_end
            # Optimistic, as vLLM: rejected drafts are rolled back in update_from_output.
            request.num_computed_tokens = computed + num_new
            requests.append(request)
        plan = StepPlan(
            slots=slots,
            start_pos=start,
            num_scheduled=num_scheduled,
            num_drafts=num_drafts,
            sample=sample,
        )
        if n:  # an empty plan never runs: its diffs wait for the next one
            plan.freed_slots, self._freed_since_plan = self._freed_since_plan, []
            plan.new_requests, self._new_since_plan = self._new_since_plan, []
            plan.preempted_slots, self._preempted_since_plan = self._preempted_since_plan, []
            plan.discarded_request_ids, self._discarded_since_plan = self._discarded_since_plan, []
        if drafting:
            table = np.full((n, max(len(ids) for _, ids in drafting)), -1, dtype=np.int64)
            for i, ids in drafting:
                table[i, : len(ids)] = ids
            plan.draft_token_ids = table
        total = int(num_scheduled.sum())
        num_alternatives = sum(len(ids) for _, ids in alternatives)
        # Alternatives run as tokens of the forward: only where the step's budget still has room for them.
        if num_alternatives and total + num_alternatives <= self.token_budget:
            table = np.full((n, max(len(ids) for _, ids in alternatives)), -1, dtype=np.int64)
            for i, ids in alternatives:
                table[i, : len(ids)] = ids
            plan.draft_alternatives = table
        out = SchedulerOutput(plan, requests, prefill_tokens, total - prefill_tokens,
                              self._queried_since_plan, self._cached_since_plan)  # fmt: skip
        self._queried_since_plan = self._cached_since_plan = 0
        return out

    # -- results -----------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        plan = out.plan
        for row, request in enumerate(out.requests):
            if request.status.is_finished:
                continue  # finished while the step ran; its slot may already be someone else's
            has_prompt_logprobs = result.prompt_logprobs is not None and row in result.prompt_logprobs
            num_sampled = int(result.num_sampled[row])
            if num_sampled == 0:
                if has_prompt_logprobs:
                    updates.append(RequestUpdate(request, row, [], False, prompt_logprobs_rows=[row]))
                continue
            num_drafts = int(plan.num_drafts[row])
            accepted_drafts = num_sampled - 1
            request.num_computed_tokens -= num_drafts - accepted_drafts
            request.spec_token_ids = []
            new_tokens: list[int] = []
            finished = False
            for token in result.sampled_token_ids[row, :num_sampled].tolist():
                request.output_token_ids.append(token)
                new_tokens.append(token)
                if request.check_stop(self.max_model_len):
                    finished = True
                    break  # tokens after a stop are dropped
            updates.append(
                RequestUpdate(
                    request,
                    row,
                    new_tokens,
                    finished,
                    num_drafts=num_drafts,
                    num_accepted_drafts=accepted_drafts,
                    prompt_logprobs_rows=[row] if has_prompt_logprobs else [],
                )
            )
            if finished:
                self._free(request)
        return updates


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays (one vectorised pass, not a loop per token)."""
    m = min(len(a), len(b))
    differ = a[:m] != b[:m]
    return int(differ.argmax()) if differ.any() else m
