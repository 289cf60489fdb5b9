"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from nxdserve.api.chat import render_prompt
from nxdserve.api.errors import APIError, from_exception
from nxdserve.api.generation import ChoiceState, EngineCall, merge
from nxdserve.api.params import build_sampling_params
from nxdserve.api.protocol import ChatCompletionRequest
from nxdserve.api.responses_api.events import EventWriter
from nxdserve.api.responses_api.inputs import conversation
from nxdserve.api.responses_api.protocol import (
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    check_supported,
)
from nxdserve.api.responses_api.store import ResponseStore, StoredResponse
from nxdserve.api.state import ServerState, base_request_id, engine_request_ids, get_state, parse
from nxdserve.api.streaming import EventStreamResponse, respond


def _store(state: ServerState) -> ResponseStore:
    return state.responses


async def create_response(request: Request) -> Response | EventStreamResponse:
    state = get_state(request)
    req = await parse(request, ResponsesRequest)
    model = state.resolve_model(req.model)
    check_supported(req)
    messages, turn = conversation(req, _store(state))
    # The chat machinery renders the prompt and builds the sampling parameters (the model's generation
    # defaults where the request leaves them out), so both endpoints validate alike.
    chat = ChatCompletionRequest(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        user=req.user,
    )
    engine = state.engine
    prompt = render_prompt(engine, chat)
    params = build_sampling_params(chat, engine.generation_defaults, engine.vocab_size, state.max_logprobs)
    response_id = f"resp_{base_request_id(request)}"
    (request_id,) = engine_request_ids(request, response_id, 1)
    state.log_request(response_id, [prompt], params)
    skeleton = ResponseObject(
        id=response_id,
        model=model,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        previous_response_id=req.previous_response_id,
        temperature=params.temperature,
        top_p=params.top_p,
        tool_choice=req.tool_choice if isinstance(req.tool_choice, str) else "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False,
        store=req.store is not False,
        metadata=req.metadata or {},
        user=req.user,
    )
    view = _ResponsesView(state, skeleton, turn, message_id=f"msg_{uuid.uuid4().hex}")
    call = EngineCall(prompt, params, request_id, False, state.lora_for(model))
    return await respond(request, engine, [call], view, bool(req.stream))


async def retrieve_response(request: Request) -> Response:
    entry = _store(get_state(request)).get(request.path_params["response_id"])
    if entry is None:
        raise _not_found(request.path_params["response_id"])
    return JSONResponse(entry.response.model_dump(mode="json"))


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not _store(get_state(request)).delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _not_found(response_id: str) -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", status=404, param="response_id")


@dataclass
class _ResponsesView:
    state: ServerState
    skeleton: ResponseObject
    turn: list[dict[str, Any]]
    message_id: str
    _done: bool = field(default=False)

    def finish(self, st: ChoiceState) -> ResponseObject:
        """The final response object, stored unless ``store`` is false."""
        incomplete = st.finish_reason == "length"
        status: Literal["incomplete", "completed"] = "incomplete" if incomplete else "completed"
        message = OutputMessage(id=self.message_id, status=status, content=[OutputText(text=st.text)])
        prompt_tokens = len(st.prompt_token_ids)
        response = self.skeleton.model_copy(
            update={
                "status": status,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": [message],
                "usage": ResponseUsage(
                    input_tokens=prompt_tokens, output_tokens=st.num_tokens, total_tokens=prompt_tokens + st.num_tokens
                ),
            }
        )
        if response.store:
            messages = [*self.turn, {"role": "assistant", "content": st.text}]
            self.state.responses.put(StoredResponse(response, messages))
        return response

    def response(self, states: Sequence[ChoiceState]) -> ResponseObject:
        return self.finish(states[0])

    async def frames(self, streams: Sequence[Any]) -> AsyncIterator[str]:
        """OpenAI's typed events: created, in_progress, the message item and its text part opening, one
        output_text.delta per engine output, then the closing events and response.completed."""
        events = EventWriter(self.skeleton, self.message_id)
        for frame in events.opening():
            yield frame
        st = ChoiceState(index=0)
        outputs = merge(streams)
        try:
            async for _, out in outputs:
                st.update(out)
                delta = out.outputs[0].text if out.outputs else ""
                if delta:
                    yield events.delta(delta)
            for frame in events.closing(self.finish(st)):
                yield frame
        except Exception as exc:  # headers are out: report in-band as OpenAI does
            yield events.error(from_exception(exc))
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
