"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from nxdserve.api.chat_output import apply_structured_defaults
from nxdserve.api.errors import sse_error_frame
from nxdserve.api.generation import ChoiceState, EngineCall, merge
from nxdserve.api.logprobs import TokenIdNames, completion_logprobs
from nxdserve.api.params import (
    build_sampling_params,
    check_completion,
    check_fan_out,
    normalize_prompts,
)
from nxdserve.api.protocol import CompletionRequest
from nxdserve.api.responses import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    CompletionStreamResponse,
    UsageInfo,
    now,
)
from nxdserve.api.state import ServerState, base_request_id, engine_request_ids, get_state, parse
from nxdserve.api.streaming import DONE_FRAME, EventStreamResponse, TextChunkFrames, respond, sse_frame
from nxdserve.engine.choices import child_params
from nxdserve.engine.outputs import Logprob


async def create_completion(request: Request) -> Response | EventStreamResponse:
    state = get_state(request)
    req = await parse(request, CompletionRequest)
    model = state.resolve_model(req.model)
    check_completion(req)
    engine = state.engine
    prompts = normalize_prompts(req.prompt, engine.vocab_size)
    check_fan_out(len(prompts), req.n)
    params = build_sampling_params(req, engine.generation_defaults, engine.vocab_size, state.max_logprobs)
    apply_structured_defaults(params, engine.config)
    await engine.prepare(params)  # structured outputs: the grammar compiles off the event loop
    children = child_params(params)
    response_id = f"cmpl-{base_request_id(request, req.request_id)}"
    ids = iter(engine_request_ids(request, response_id, len(prompts) * len(children), req.request_id))
    lora = state.lora_for(model)
    calls = [EngineCall(prompt, c, next(ids), req.add_special_tokens, lora, req.priority)
             for prompt in prompts for c in children]
    state.log_request(response_id, prompts, params)
    view = _CompletionView(state, req, model, response_id, calls)
    return await respond(request, engine, calls, view, bool(req.stream))


@dataclass
class _CompletionView:
    """Turns per-choice engine state into OpenAI completion objects."""

    state: ServerState
    req: CompletionRequest
    model: str
    response_id: str
    calls: Sequence[EngineCall]

    @property
    def n(self) -> int:
        return self.req.n

    @property
    def drop_generated(self) -> bool:
        # echo with max_tokens=0: the engine generated one token that the client did not ask for.
        return self.req.echo and self.req.max_tokens == 0

    def _prompt_text(self, st: ChoiceState) -> str:
        prompt = self.calls[st.index].prompt
        if isinstance(prompt, str):
            return prompt
        return st.prompt if st.prompt is not None else self.state.tokenizer.decode(st.prompt_token_ids)

    def _prompt_logprob_steps(self, st: ChoiceState) -> list[dict[int, Logprob] | None]:
        steps = list(st.prompt_logprobs or [])
        return steps + [None] * (len(st.prompt_token_ids) - len(steps))

    def _logprobs(
        self, token_ids: list[int], steps: Sequence[dict[int, Logprob] | None], offset: int
    ) -> CompletionLogProbs | None:
        if self.req.logprobs is None:
            return None
        names = TokenIdNames() if self.req.return_tokens_as_token_ids else self.state.tokenizer
        return completion_logprobs(token_ids, steps, self.req.logprobs, names, offset)

    def _usage(self, states: Sequence[ChoiceState]) -> UsageInfo:
        # Each prompt counts once however many choices it has (n children share it).
        prompt_tokens = sum(len(states[k].prompt_token_ids) for k in range(0, len(states), self.n))
        completion_tokens = 0 if self.drop_generated else sum(st.num_tokens for st in states)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    def _prompt_logprobs_field(self, st: ChoiceState) -> list[dict[int, dict[str, Any]] | None] | None:
        if self.req.prompt_logprobs is None:
            return None
        return [
            None if step is None else {tid: vars(lp).copy() for tid, lp in step.items()}
            for step in self._prompt_logprob_steps(st)
        ]

    def response(self, states: Sequence[ChoiceState]) -> CompletionResponse:
        choices = []
        for st in states:
            steps: list[dict[int, Logprob] | None] = list(st.logprobs)
            text, token_ids = st.text, st.token_ids
            if self.drop_generated:
                text, token_ids, steps = "", [], []
            if self.req.echo:
                text = self._prompt_text(st) + text
                token_ids = st.prompt_token_ids + token_ids
                steps = self._prompt_logprob_steps(st) + steps
            choices.append(
                CompletionChoice(
                    index=st.index,
                    text=text,
                    logprobs=self._logprobs(token_ids, steps, 0),
                    finish_reason=st.finish_reason,
                    stop_reason=st.stop_reason,
                    prompt_logprobs=self._prompt_logprobs_field(st),
                )
            )
        return CompletionResponse(id=self.response_id, model=self.model, choices=choices, usage=self._usage(states))

    async def frames(self, streams: Sequence[Any]) -> AsyncIterator[str]:
        """SSE frames: one choice per chunk, finish_reason on each choice's last chunk only, then an
        optional usage chunk with ``choices: []``, then [DONE] (also after an error frame)."""
        created = now()
        fast = TextChunkFrames(self.response_id, "text_completion", created, self.model, chat=False)
        states = [ChoiceState(index=i) for i in range(len(streams))]
        offsets = [0] * len(streams)
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        outputs = merge(streams)
        try:
            async for i, out in outputs:
                st = states[i]
                first = not st.prompt_token_ids
                seen_tokens, seen_logprobs = len(st.token_ids), len(st.logprobs)
                st.update(out)
                text = out.outputs[0].text if out.outputs else ""
                token_ids = st.token_ids[seen_tokens:]
                steps: list[dict[int, Logprob] | None] = list(st.logprobs[seen_logprobs:])
                if self.drop_generated:
                    text, token_ids, steps = "", [], []
                if first and self.req.echo:
                    text = self._prompt_text(st) + text
                    token_ids = st.prompt_token_ids + token_ids
                    steps = self._prompt_logprob_steps(st) + steps
                if not text and not token_ids and st.finish_reason is None:
                    continue  # nothing new to say (e.g. text held back by a stop-string check)
                logprobs = self._logprobs(token_ids, steps, offsets[i])
                if logprobs is None and not continuous:  # a token's chunk: from the template
                    yield fast.frame(i, text, st.finish_reason, st.stop_reason)
                    offsets[i] += len(text)
                    continue
                choice = CompletionChoice(
                    index=i,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=st.finish_reason,
                    stop_reason=st.stop_reason,
                )
                offsets[i] += len(text)
                chunk = CompletionStreamResponse(
                    id=self.response_id, created=created, model=self.model, choices=[choice]
                )
                if continuous:
                    chunk.usage = _choice_usage(st, self.drop_generated)
                yield sse_frame(chunk)
            if include_usage:
                usage = self._usage(states)
                yield sse_frame(
                    CompletionStreamResponse(
                        id=self.response_id, created=created, model=self.model, choices=[], usage=usage
                    )
                )
        except Exception as exc:  # headers are sent: report in-band, then [DONE]
            yield sse_error_frame(exc)
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        yield DONE_FRAME


def _choice_usage(st: ChoiceState, drop_generated: bool) -> UsageInfo:
    completion = 0 if drop_generated else st.num_tokens
    prompt = len(st.prompt_token_ids)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
