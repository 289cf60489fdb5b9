"""A response's output items as the generated text grows (reasoning, message, function calls), and the
Responses API's server-sent events that announce each step: ``event: <type>`` + ``data: <json>`` with a rising
``sequence_number`` (OpenAI's framing; the SDK reads the type from the data).

Streaming and non-streaming responses build their items through the same ``OutputItems``, so the items a stream
announces are the items of its ``response.completed``."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from nxdserve.api.errors import APIError
from nxdserve.api.responses_api.protocol import (
    FunctionCallItem,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
)


class EventWriter:
    def __init__(self) -> None:
        self.sequence_number = 0

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def opening(self, skeleton: ResponseObject) -> Iterator[str]:
        response = skeleton.model_dump(mode="json")
        yield self.event("response.created", response=response)
        yield self.event("response.in_progress", response=response)

    def closing(self, final: ResponseObject) -> str:
        kind = "response.completed" if final.status == "completed" else "response.incomplete"
        return self.event(kind, response=final.model_dump(mode="json"))

    def error(self, err: APIError) -> str:
        return self.event("error", code=str(err.status), message=err.message, param=err.param)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def new_call_id() -> str:
    return _new_id("call")


class OutputItems:
    """The output items, one open at a time: text, reasoning and call arguments append to the open item of their
    kind, and starting another kind closes it (status completed). ``frames`` collects the events."""

    def __init__(self, events: EventWriter, make_call_id: Callable[[], str] = new_call_id) -> None:
        self.events = events
        self.make_call_id = make_call_id
        self.items: list[OutputItem] = []
        self.frames: list[str] = []
        self._open: OutputItem | None = None
        self._calls: dict[int, FunctionCallItem] = {}  # the parser's call index -> its item

    def drain(self) -> list[str]:
        frames, self.frames = self.frames, []
        return frames

    def _emit(self, kind: str, **fields: Any) -> None:
        self.frames.append(self.events.event(kind, **fields))

    def _where(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.items.index(item)}

    def _add(self, item: OutputItem) -> None:
        self.close()
        self.items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=item.model_dump(mode="json"))

    # -- growing the output --------------------------------------------------------------------------
    def open_message(self) -> OutputMessage:
        if isinstance(self._open, OutputMessage):
            return self._open
        message = OutputMessage(id=_new_id("msg"), status="in_progress")
        self._add(message)
        message.content.append(OutputText(text=""))
        self._emit("response.content_part.added", **self._where(message), content_index=0,
                   part=message.content[0].model_dump(mode="json"))
        return message

    def text(self, delta: str) -> None:
        if not delta:
            return
        message = self.open_message()
        message.content[0].text += delta
        self._emit("response.output_text.delta", **self._where(message), content_index=0, delta=delta, logprobs=[])

    def reasoning(self, delta: str) -> None:
        if not delta:
            return
        item = self._open
        if not isinstance(item, ReasoningItem):
            item = ReasoningItem(id=_new_id("rs"), status="in_progress")
            self._add(item)
            item.content.append(ReasoningText(text=""))
            self._emit("response.content_part.added", **self._where(item), content_index=0,
                       part=item.content[0].model_dump(mode="json"))
        item.content[0].text += delta
        self._emit("response.reasoning_text.delta", **self._where(item), content_index=0, delta=delta)

    def call_start(self, index: int, name: str) -> None:
        call = FunctionCallItem(id=_new_id("fc"), call_id=self.make_call_id(), name=name, status="in_progress")
        self._calls[index] = call
        self._add(call)

    def call_arguments(self, index: int, delta: str) -> None:
        if not delta:
            return
        call = self._calls[index]
        call.arguments += delta
        self._emit("response.function_call_arguments.delta", **self._where(call), delta=delta)

    def chat_deltas(self, reasoning: str, content: str, tool_deltas: list[dict[str, Any]]) -> None:
        """One step of chat's ChoiceStreamer output (tool-call deltas in chat's streamed shape)."""
        self.reasoning(reasoning)
        self.text(content)
        for delta in tool_deltas:
            function = delta.get("function") or {}
            if "id" in delta:
                self.call_start(delta["index"], function["name"])
            if function.get("arguments"):
                self.call_arguments(delta["index"], function["arguments"])

    def chat_message(self, content: str | None, reasoning: str | None, tool_calls: list[dict[str, Any]]) -> None:
        """A finished chat message (ChatOutputPlan.message) as items: reasoning, text, then each call."""
        self.reasoning(reasoning or "")
        self.text(content or "")
        for index, call in enumerate(tool_calls):
            self.call_start(index, call["function"]["name"])
            self.call_arguments(index, call["function"]["arguments"])

    # -- closing -------------------------------------------------------------------------------------
    def close(self, status: ItemStatus = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item.status = status
        where = self._where(item)
        if isinstance(item, OutputMessage):
            part = item.content[0]
            self._emit("response.output_text.done", **where, content_index=0, text=part.text, logprobs=[])
            self._emit("response.content_part.done", **where, content_index=0, part=part.model_dump(mode="json"))
        elif isinstance(item, ReasoningItem):
            part_r = item.content[0]
            self._emit("response.reasoning_text.done", **where, content_index=0, text=part_r.text)
            self._emit("response.content_part.done", **where, content_index=0, part=part_r.model_dump(mode="json"))
        else:
            self._emit("response.function_call_arguments.done", **where, arguments=item.arguments)
        self._emit("response.output_item.done", output_index=where["output_index"], item=item.model_dump(mode="json"))

    def finish(self, status: ItemStatus) -> list[OutputItem]:
        """Close the last item with the response's status. An output with neither text nor calls still has
        its (empty) message, as OpenAI's does."""
        if not any(isinstance(item, OutputMessage | FunctionCallItem) for item in self.items):
            self.open_message()
        self.close(status)
        return self.items


def assistant_message(items: list[OutputItem]) -> dict[str, Any]:
    """The output as the chat message a follow-up turn continues: text and tool calls (call ids as the client
    sees them, so its function_call_output matches; a call cut off by max_output_tokens is left out, its arguments
being partial JSON); reasoning is left out, as chat templates drop it."""
    text = "".join(part.text for item in items if isinstance(item, OutputMessage) for part in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in items if isinstance(item, FunctionCallItem) and item.status == "completed"]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message
