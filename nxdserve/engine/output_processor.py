"""Turns per-step token updates into RequestOutputs: text deltas, stop strings, logprobs, timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nxdserve.engine.detokenizer import IncrementalDetokenizer, TokenTextCache, find_stop_string
from nxdserve.engine.outputs import CompletionOutput, Logprob, LogprobsList, RequestMetrics, RequestOutput
from nxdserve.engine.request import Request
from nxdserve.engine.step import LogprobsBlock, RequestUpdate, StepResult
from nxdserve.sampling_params import OutputKind, SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer
    stop_holdback: int  # characters withheld while streaming: a stop string may still complete
    token_ids: list[int] = field(default_factory=list)
    logprobs: LogprobsList | None = None
    prompt_logprobs: LogprobsList | None = None
    prompt_logprobs_sent: bool = False
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    final_text_len: int | None = None  # set when a stop string cuts the text


def _logprob_entries(
    block: LogprobsBlock, index: tuple[int, ...], num_top: int, texts: TokenTextCache
) -> dict[int, Logprob]:
    ids = block.token_ids[index]
    lps = block.logprobs[index]
    chosen = int(ids[0])
    entry = {chosen: Logprob(float(lps[0]), int(block.ranks[index]), texts.decode(chosen))}
    for k in range(1, num_top + 1):
        tid = int(ids[k])
        if tid not in entry:
            entry[tid] = Logprob(float(lps[k]), k, texts.decode(tid))
    return entry


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._backend_tokenizer = tokenizer.backend_tokenizer
        self._texts = TokenTextCache(tokenizer)
        self.states: dict[str, RequestState] = {}

    def add_request(self, request: Request, prompt: str | None) -> None:
        params = request.params
        self.states[request.request_id] = RequestState(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            detokenizer=IncrementalDetokenizer(
                self._backend_tokenizer, request.prompt_token_ids, params.skip_special_tokens
            ),
            stop_holdback=max((len(s) for s in params.stop), default=1) - 1,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
        )

    def process(self, updates: list[RequestUpdate], result: StepResult) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to deliver and the ids that a stop string finished (to free in the core)."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        for update in updates:
            request = update.request
            state = self.states.get(request.request_id)
            if state is None:
                continue  # aborted by its client: nothing to deliver
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = request.first_scheduled_time
            if state.prompt_logprobs is not None:
                for row in update.prompt_logprobs_rows:
                    self._add_prompt_logprobs(state, result.prompt_logprobs[row])  # type: ignore[index]
            if not update.new_token_ids:
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            state.token_ids.extend(update.new_token_ids)
            if state.logprobs is not None and result.logprobs is not None:
                num_top = state.params.logprobs or 0
                for j in range(len(update.new_token_ids)):
                    state.logprobs.append(_logprob_entries(result.logprobs, (update.row, j), num_top, self._texts))
            finish_reason = request.finish_reason if update.finished else None
            stop_reason = request.stop_reason if update.finished else None
            num_new_chars = state.detokenizer.add(_text_tokens(update.new_token_ids, request, state.params))
            if finish_reason is not None:
                num_new_chars += state.detokenizer.flush()
            if finish_reason is None and state.params.stop and len(state.token_ids) > state.params.min_tokens:
                match = find_stop_string(state.detokenizer.text, num_new_chars, state.params.stop)
                if match is not None:
                    stop, idx = match
                    state.final_text_len = idx + len(stop) if state.params.include_stop_str_in_output else idx
                    finish_reason, stop_reason = "stop", stop
                    stopped_by_string.append(request.request_id)
            out = self._make_output(state, finish_reason, stop_reason, now)
            if out is not None:
                outputs.append(out)
        return outputs, stopped_by_string

    def _add_prompt_logprobs(self, state: RequestState, block: LogprobsBlock) -> None:
        assert state.prompt_logprobs is not None
        num_top = state.params.prompt_logprobs or 0
        for i in range(block.token_ids.shape[0]):
            state.prompt_logprobs.append(_logprob_entries(block, (i,), num_top, self._texts))

    def _make_output(
        self, state: RequestState, finish_reason: str | None, stop_reason: int | str | None, now: float
    ) -> RequestOutput | None:
        finished = finish_reason is not None
        text = state.detokenizer.text
        if finished:
            end = len(text) if state.final_text_len is None else state.final_text_len
            state.metrics.finished_time = now
            self.states.pop(state.request_id, None)
        else:
            end = len(text) - state.stop_holdback if state.params.stop else len(text)
        kind = state.params.output_kind
        if kind is OutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is OutputKind.DELTA
        out_text = text[state.sent_chars : max(end, state.sent_chars)] if delta else text[:end]
        out_tokens = state.token_ids[state.sent_tokens :] if delta else list(state.token_ids)
        out_logprobs = None
        if state.logprobs is not None:
            out_logprobs = state.logprobs[state.sent_logprobs :] if delta else list(state.logprobs)
        if delta and not out_text and not out_tokens and not finished:
            return None
        state.sent_chars = max(end, state.sent_chars)
        state.sent_tokens = len(state.token_ids)
        state.sent_logprobs = len(state.logprobs) if state.logprobs is not None else 0
        prompt_logprobs = None
        if state.prompt_logprobs is not None and (not state.prompt_logprobs_sent or not delta):
            prompt_logprobs = [None, *state.prompt_logprobs]
            state.prompt_logprobs_sent = True
        completion = CompletionOutput(
            index=0,
            text=out_text,
            token_ids=out_tokens,
            cumulative_num_tokens=len(state.token_ids),
            logprobs=out_logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=state.metrics,
            prompt_logprobs=prompt_logprobs,  # type: ignore[arg-type]
        )

    def finish_without_output(
        self, request_id: str, finish_reason: str, error: str | None = None
    ) -> RequestOutput | None:
        """Final output for a request ended outside the normal flow (abort, engine error)."""
        state = self.states.get(request_id)
        if state is None:
            return None
        out = self._make_output(state, finish_reason, None, time.monotonic())
        if out is None:  # FINAL_ONLY requests always get an output when finishing
            return None
        out.error = error
        return out

    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)


def _text_tokens(new_token_ids: list[int], request: Request, params: SamplingParams) -> list[int]:
    """The new tokens whose text the output shows. A request that ended on its end token or one of its
    ``stop_token_ids`` keeps that token in ``token_ids`` but not its text, unless ``include_stop_str_in_output``
    (as vLLM's detokenizer): with ``skip_special_tokens`` off an ``<|im_end|>`` would otherwise end the text,
    and tool-call parsers would read it as trailing content."""
    stopped_on_token = request.finish_reason == "stop" and not isinstance(request.stop_reason, str)
    if stopped_on_token and not params.include_stop_str_in_output and new_token_ids:
        return new_token_ids[:-1]
    return new_token_ids
