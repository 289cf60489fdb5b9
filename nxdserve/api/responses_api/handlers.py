"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from nxdserve.api.chat import plan_chat_generation
from nxdserve.api.chat_output import ChatOutputPlan
from nxdserve.api.errors import APIError, from_exception, raise_with_request_names
from nxdserve.api.generation import ChoiceState, EngineCall, merge
from nxdserve.api.protocol import ChatCompletionRequest
from nxdserve.api.responses_api.events import EventWriter, OutputItems, assistant_message, new_call_id
from nxdserve.api.responses_api.inputs import conversation
from nxdserve.api.responses_api.protocol import (
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    check_supported,
)
from nxdserve.api.responses_api.store import ResponseStore, StoredResponse
from nxdserve.api.responses_api.tools import chat_response_format, chat_tool_choice, chat_tools
from nxdserve.api.state import ServerState, base_request_id, engine_request_ids, get_state, parse
from nxdserve.api.streaming import EventStreamResponse, respond
from nxdserve.tools import ToolParser


def _store(state: ServerState) -> ResponseStore:
    return state.responses


async def create_response(request: Request) -> Response | EventStreamResponse:
    state = get_state(request)
    req = await parse(request, ResponsesRequest)
    model = state.resolve_model(req.model)
    check_supported(req)
    messages, turn = conversation(req, _store(state))
    # Chat's machinery renders the prompt, reads tool calls and builds the sampling parameters (the model's
    # generation defaults where the request leaves them out), so both endpoints validate and behave alike.
    chat = ChatCompletionRequest(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        user=req.user,
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        response_format=chat_response_format(req.text),  # type: ignore[arg-type]
    )
    engine = state.engine
    try:
        plan, prompt, params = await plan_chat_generation(engine, chat, state.max_logprobs)
    except Exception as exc:  # errors name this endpoint's fields, not the chat request's it was mapped onto
        raise_with_request_names(exc, _CHAT_TO_RESPONSES, _CHAT_WORDS)
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
        tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
        tools=req.tools or [],
        parallel_tool_calls=req.parallel_tool_calls is not False,
        text=req.text or {"format": {"type": "text"}},
        store=req.store is not False,
        metadata=req.metadata or {},
        user=req.user,
    )
    view = _ResponsesView(state, skeleton, turn, plan)
    call = EngineCall(prompt, params, request_id, False, state.lora_for(model), priority=req.priority)
    try:
        return await respond(request, engine, [call], view, bool(req.stream))
    except Exception as exc:  # the engine's admission errors (lengths) name chat's fields too
        raise_with_request_names(exc, _CHAT_TO_RESPONSES, _CHAT_WORDS)


def finished_items(items: OutputItems, plan: ChatOutputPlan, text: str) -> None:
    """A finished text's output items, read as a stream reads it: the same items in the same order as the
    streamed response (a call before the text that follows a malformed one, say)."""
    if plan.mode == "none" and plan.reasoning is None:
        items.chat_message(*plan.message(text))
        return
    streamer = plan.streamer()
    items.chat_deltas(*streamer.feed(text, final=False))
    items.chat_deltas(*streamer.feed("", final=True))


# Chat's field -> the Responses field it was made from (handlers above); the words renamed in messages too
_CHAT_TO_RESPONSES = {"response_format": "text", "max_completion_tokens": "max_output_tokens",
                      "max_tokens": "max_output_tokens", "messages": "input", "prompt": "input"}
_CHAT_WORDS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
               "response_format": "text.format"}



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


def _call_id_maker(plan: ChatOutputPlan) -> Callable[[], str]:
    """OpenAI's ``call_<hex>`` ids, unless the parser's model needs its own shape (Mistral's templates check for
    9 alphanumerics): the id goes back through the template with the client's function_call_output."""
    parser = plan.tool_parser
    if parser is not None and type(parser).new_call_id is not ToolParser.new_call_id:
        return parser.new_call_id
    return new_call_id


@dataclass
class _ResponsesView:
    state: ServerState
    skeleton: ResponseObject
    turn: list[dict[str, Any]]
    plan: ChatOutputPlan

    def _items(self, events: EventWriter) -> OutputItems:
        return OutputItems(events, _call_id_maker(self.plan))

    def _finish(self, st: ChoiceState, items: OutputItems) -> ResponseObject:
        """The final response object (closing the last item), stored unless ``store`` is false."""
        incomplete = st.finish_reason == "length"
        status: Literal["incomplete", "completed"] = "incomplete" if incomplete else "completed"
        output = items.finish(status)
        prompt_tokens = len(st.prompt_token_ids)
        response = self.skeleton.model_copy(
            update={
                "status": status,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": output,
                "usage": ResponseUsage(
                    input_tokens=prompt_tokens, output_tokens=st.num_tokens, total_tokens=prompt_tokens + st.num_tokens
                ),
            }
        )
        if response.store:
            self.state.responses.put(StoredResponse(response, [*self.turn, assistant_message(output)]))
        return response

    def response(self, states: Sequence[ChoiceState]) -> ResponseObject:
        st = states[0]
        items = self._items(EventWriter())  # its events are not sent
        finished_items(items, self.plan, st.text)
        return self._finish(st, items)

    async def frames(self, streams: Sequence[Any]) -> AsyncIterator[str]:
        """OpenAI's typed events: created, in_progress, then each output item's added / delta / done events as
        the text grows (plain text opens its message at once), then response.completed (or .incomplete)."""
        events = EventWriter()
        for frame in events.opening(self.skeleton):
            yield frame
        items = self._items(events)
        plain = self.plan.mode == "none" and self.plan.reasoning is None
        streamer = None if plain else self.plan.streamer()
        if plain:
            items.open_message()
        st = ChoiceState(index=0)
        outputs = merge(streams)
        try:
            async for _, out in outputs:
                st.update(out)
                delta = out.outputs[0].text if out.outputs else ""
                if streamer is None:
                    items.text(delta)
                else:
                    items.chat_deltas(*streamer.feed(delta, final=st.finish_reason is not None))
                for frame in items.drain():
                    yield frame
            final = self._finish(st, items)
            for frame in items.drain():
                yield frame
            yield events.closing(final)
        except Exception as exc:  # headers are out: report in-band as OpenAI does
            yield events.error(from_exception(exc))
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
