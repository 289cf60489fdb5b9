"""OpenAI's streamed tool calls from a growing text: per call, one delta with index, id, type, name and arguments,
sent once the call is complete; content deltas for the text before the calls. A parser whose calls cannot turn
out malformed (``streams_arguments``: a grammar writes them) sends the name first and the arguments as they grow.

The non-streaming response is read by this same streamer over the whole text (``read_whole``), so a streamed
choice assembles to exactly the non-streamed one: a stream never sends a call the final reading drops. When a
malformed call follows complete ones, those calls stand and the content is the whole text (``_guarded``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nxdserve.tools.base import ParsedCall, ParsedOutput, ToolParser


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallStreamer:
    parser: ToolParser
    text: str = ""
    content_sent: int = 0
    calls: list[_SentCall] = field(default_factory=list)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """The new text's content delta and tool-call deltas."""
        self.text += delta
        return self._diff(self.parser.parse(self.text, final=False), final=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left once the text is complete: held-back content, the calls (or arguments) not yet sent."""
        return self._diff(self.parser.parse(self.text, final=True), final=True)

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def _diff(self, parsed: ParsedOutput, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content = ""
        # Content is a prefix of the text: before the first call, or all of it once a call proved malformed.
        # Until a call's marker has come, its trailing whitespace waits for what follows (whitespace alone before
        # a call is no content); once a call is seen, the content before it is settled.
        visible = parsed.content
        if visible is not None and not (final or parsed.calls):
            visible = visible.rstrip()
        if visible is not None and (not self.calls or parsed.malformed) and len(visible) > self.content_sent:
            content = visible[self.content_sent:]
            self.content_sent = len(visible)
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.calls):
            if self.parser.streams_arguments:
                deltas += self._grow(index, call)
            elif index >= len(self.calls):
                if not call.complete:
                    break
                sent = _SentCall(self.parser.new_call_id(), call.name, call.arguments)
                self.calls.append(sent)
                deltas.append({"index": index, "id": sent.id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
        return content, deltas

    def _grow(self, index: int, call: ParsedCall) -> list[dict[str, Any]]:
        """A call's name once, then each new stretch of its arguments."""
        deltas: list[dict[str, Any]] = []
        if index >= len(self.calls):
            sent = _SentCall(self.parser.new_call_id(), call.name)
            self.calls.append(sent)
            deltas.append({"index": index, "id": sent.id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
        sent = self.calls[index]
        if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(sent.arguments):
            deltas.append({"index": index, "function": {"arguments": call.arguments[len(sent.arguments):]}})
            sent.arguments = call.arguments
        return deltas


def read_whole(parser: ToolParser, text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls as OpenAI's tool_calls entries) of a finished text, as its stream assembles them."""
    streamer = ToolCallStreamer(parser)
    content, deltas = streamer.feed(text)
    more_content, more = streamer.finish()
    calls: list[dict[str, Any]] = []
    for delta in deltas + more:
        if "id" in delta:
            calls.append({"id": delta["id"], "type": "function", "function": dict(delta["function"])})
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return content + more_content, calls
