"""POST /v1/chat/completions."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from nxdserve.api.chat_output import ChatOutputPlan
from nxdserve.api.engine_protocol import EngineClient
from nxdserve.api.errors import APIError, raise_with_request_names, sse_error_frame
from nxdserve.api.generation import ChoiceState, EngineCall, merge
from nxdserve.api.logprobs import TokenIdNames, chat_logprobs
from nxdserve.api.multimodal import load_chat_images, require_image_support
from nxdserve.api.params import build_sampling_params, chat_field_names, check_chat, check_fan_out
from nxdserve.api.protocol import ChatCompletionRequest, ChatMessage
from nxdserve.api.responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogProbs,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    now,
)
from nxdserve.api.state import ServerState, base_request_id, engine_request_ids, get_state, parse
from nxdserve.api.streaming import DONE_FRAME, EventStreamResponse, TextChunkFrames, respond, sse_frame
from nxdserve.engine.choices import child_params
from nxdserve.engine.outputs import Logprob
from nxdserve.engine.prompts import ProcessedPrompt
from nxdserve.errors import NxdServeError
from nxdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def message_dicts(messages: Sequence[ChatMessage], content_format: str = "string") -> list[dict[str, Any]]:
    """Messages as the chat template sees them: text parts joined into one string (vLLM's "string"
    content format, which every text-only template understands; "auto" is that too), or kept as a list of
    {"type": "text", "text"} parts for templates that iterate them ("openai")."""
    out = []
    for msg in messages:
        if msg.role not in CHAT_ROLES:
            raise APIError(f"Unsupported message role {msg.role!r}.", param="messages")
        entry = msg.model_dump(exclude_none=True)
        if msg.tool_calls is not None:
            entry["tool_calls"] = _template_tool_calls(msg.tool_calls)
            if not entry["tool_calls"]:
                del entry["tool_calls"]
        content = msg.content
        if isinstance(content, list) and any(part.type == "image_url" for part in content):
            # Images (checked and loaded by api.multimodal): the template places each {"type": "image"} part's
            # placeholder, so the parts stay a list whatever the content format.
            entry["content"] = [_image_or_text_part(part) for part in content]
        elif isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        f"Unsupported content part type {part.type!r}; only 'text' parts are supported.",
                        param="messages",
                    )
                texts.append(part.text)
            entry["content"] = ([{"type": "text", "text": t} for t in texts] if content_format == "openai"
                                else "\n".join(texts))
        elif content is None:
            entry["content"] = ""  # templates print None literally
        out.append(entry)
    return out


def _image_or_text_part(part: Any) -> dict[str, Any]:
    if part.type == "image_url":
        return {"type": "image"}
    if part.type != "text" or part.text is None:
        raise APIError(f"Unsupported content part type {part.type!r}.", param="messages")
    return {"type": "text", "text": part.text}


def _template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's tool calls as templates expect them: each ``function.arguments`` JSON string parsed
    into a dict (vLLM's rule; templates iterate it or apply ``tojson``), empty arguments as {}."""
    out = []
    for call in calls:
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError("An assistant tool call needs function.name.", param="messages")
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise APIError(f"Tool call arguments are not valid JSON: {exc}", param="messages") from exc
        out.append({**call, "function": {**fn, "arguments": arguments if arguments is not None else {}}})
    return out


def render_prompt(engine: EngineClient, req: ChatCompletionRequest | Any) -> str:
    """The rendered chat template; template errors (e.g. roles that must alternate) are 400s."""
    try:
        return engine.apply_chat_template(
            message_dicts(req.messages, getattr(engine.config, "chat_template_content_format", "string")),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs,
            tools=req.tools,
        )
    except (APIError, NxdServeError):
        raise
    except Exception as exc:  # jinja2 TemplateError, "no chat template" ValueError, ...
        raise APIError(f"Cannot apply the chat template: {exc}", param="messages") from exc


async def plan_chat_generation(engine: EngineClient, req: ChatCompletionRequest, max_logprobs: int
                               ) -> tuple[ChatOutputPlan, str, SamplingParams]:
    """How the output is read (tool choice, parsers), the rendered prompt, and the sampling parameters with the
    constraint the tool choice implies; the grammar compiled. Shared by chat and the Responses API."""
    plan = ChatOutputPlan.build(req, engine.config)
    prompt = render_prompt(engine, req)
    params = build_sampling_params(req, engine.generation_defaults, engine.vocab_size, max_logprobs)
    plan.constrain(params, prompt, engine.tokenizer, engine.config)
    await engine.prepare(params)  # structured outputs: the grammar compiles off the event loop
    return plan, prompt, params


async def create_chat_completion(request: Request) -> Response | EventStreamResponse:
    state = get_state(request)
    req = await parse(request, ChatCompletionRequest)
    model = state.resolve_model(req.model)
    check_chat(req)
    check_fan_out(1, req.n)
    engine = state.engine
    images = await load_chat_images(req.messages, state.media)
    require_image_support(engine, images)
    plan, text, params = await plan_chat_generation(engine, req, state.max_logprobs)
    prompt: str | ProcessedPrompt = text
    if images:  # the model's processor, in a worker thread: patches, and the image tokens in the prompt
        processed = await engine.process_prompt(
            {"prompt": text, "multi_modal_data": {"image": [image.image for image in images]}},
            req.add_special_tokens,
        )
        assert isinstance(processed, ProcessedPrompt)
        prompt = processed
    children = child_params(params)
    response_id = f"chatcmpl-{base_request_id(request, req.request_id)}"
    ids = engine_request_ids(request, response_id, len(children), req.request_id)
    lora = state.lora_for(model)
    calls = [EngineCall(prompt, c, rid, req.add_special_tokens, lora, req.priority)
             for c, rid in zip(children, ids, strict=True)]
    state.log_request(response_id, [text], params)
    view = _ChatView(state, req, model, response_id, plan)
    try:
        return await respond(request, engine, calls, view, bool(req.stream))
    except Exception as exc:  # the engine's admission errors name max_tokens: name what the client sent
        raise_with_request_names(exc, chat_field_names(req), chat_field_names(req))


@dataclass
class _ChatView:
    state: ServerState
    req: ChatCompletionRequest
    model: str
    response_id: str
    plan: ChatOutputPlan

    def _logprobs(self, token_ids: list[int], steps: Sequence[dict[int, Logprob]]) -> ChatLogProbs | None:
        if not self.req.logprobs:
            return None
        names = TokenIdNames() if self.req.return_tokens_as_token_ids else self.state.tokenizer
        return chat_logprobs(token_ids, steps, self.req.top_logprobs or 0, names)

    def response(self, states: Sequence[ChoiceState]) -> ChatCompletionResponse:
        choices = []
        for st in states:
            content, reasoning, tool_calls = self.plan.message(st.text)
            choices.append(ChatChoice(
                index=st.index,
                message=ChatMessageOut(role="assistant", content=content, reasoning_content=reasoning,
                                       tool_calls=tool_calls),
                logprobs=self._logprobs(st.token_ids, st.logprobs),
                finish_reason=self.plan.finish_reason(st.finish_reason, bool(tool_calls)),
                stop_reason=st.stop_reason,
            ))
        prompt_tokens = len(states[0].prompt_token_ids)
        completion_tokens = sum(st.num_tokens for st in states)
        usage = UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        return ChatCompletionResponse(id=self.response_id, model=self.model, choices=choices, usage=usage)

    def _chunk(self, created: int, choices: list[ChatStreamChoice]) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.response_id, created=created, model=self.model, choices=choices)

    async def frames(self, streams: Sequence[Any]) -> AsyncIterator[str]:
        """Chat SSE frames: a role chunk per choice first, content deltas, finish_reason on each
        choice's last chunk, an optional usage chunk, then [DONE] (also after an error frame)."""
        created = now()
        fast = TextChunkFrames(self.response_id, "chat.completion.chunk", created, self.model, chat=True)
        states = [ChoiceState(index=i) for i in range(len(streams))]
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        role_sent = False
        plain = self.plan.mode == "none" and self.plan.reasoning is None
        streamers = [self.plan.streamer() for _ in streams]
        outputs = merge(streams)
        try:
            async for i, out in outputs:
                st = states[i]
                seen_tokens, seen_logprobs = len(st.token_ids), len(st.logprobs)
                st.update(out)
                if not role_sent:
                    role_sent = True
                    for k in range(len(streams)):
                        delta = DeltaMessage(role="assistant", content="")
                        chunk = self._chunk(
                            created, [ChatStreamChoice(index=k, delta=delta, logprobs=None, finish_reason=None)]
                        )
                        if continuous:
                            chunk.usage = _usage(len(st.prompt_token_ids), 0)
                        yield sse_frame(chunk)
                text = out.outputs[0].text if out.outputs else ""
                token_ids, steps = st.token_ids[seen_tokens:], st.logprobs[seen_logprobs:]
                if not text and not token_ids and st.finish_reason is None:
                    continue
                logprobs = self._logprobs(token_ids, steps)
                if plain and logprobs is None and not continuous:  # a token's chunk: from the template
                    yield fast.frame(i, text, st.finish_reason, st.stop_reason)
                    continue
                finish_reason = st.finish_reason
                if plain:
                    delta = DeltaMessage(content=text)
                else:
                    streamer = streamers[i]
                    reasoning, content, tool_deltas = streamer.feed(text, final=st.finish_reason is not None)
                    finish_reason = self.plan.finish_reason(st.finish_reason, streamer.called)
                    if not (reasoning or content or tool_deltas or finish_reason or logprobs):
                        continue
                    delta = _delta(reasoning, content, tool_deltas)
                choice = ChatStreamChoice(
                    index=i,
                    delta=delta,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=st.stop_reason,
                )
                chunk = self._chunk(created, [choice])
                if continuous:
                    chunk.usage = _usage(len(st.prompt_token_ids), st.num_tokens)
                yield sse_frame(chunk)
            if include_usage:
                prompt_tokens = len(states[0].prompt_token_ids)
                chunk = self._chunk(created, [])
                chunk.usage = _usage(prompt_tokens, sum(st.num_tokens for st in states))
                yield sse_frame(chunk)
        except Exception as exc:  # headers are sent: report in-band, then [DONE]
            yield sse_error_frame(exc)
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        yield DONE_FRAME


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def _delta(reasoning: str, content: str, tool_calls: list[dict[str, Any]]) -> DeltaMessage:
    """Only the fields that carry news (exclude_unset drops the others from the frame)."""
    fields: dict[str, Any] = {}
    if reasoning:
        fields["reasoning_content"] = reasoning
    if content or not (reasoning or tool_calls):
        fields["content"] = content
    if tool_calls:
        fields["tool_calls"] = tool_calls
    return DeltaMessage(**fields)
