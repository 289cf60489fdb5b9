"""OpenAI's streamed tool calls from a growing text: per call, one delta with index, id, type and name (arguments
""), then argument fragments; content deltas for the text around them. The fragments of a call concatenate to the
arguments of the non-streaming response (both come from the same parser over the same text)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nxdserve.tools.base import ParsedOutput, ToolParser


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
        return self._diff(self.parser.parse(self.text, final=False))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left once the text is complete: held-back content, the rest of each call's arguments."""
        return self._diff(self.parser.parse(self.text, final=True))

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def _diff(self, parsed: ParsedOutput) -> tuple[str, list[dict[str, Any]]]:
        content = ""
        if parsed.content is not None and not self.calls and len(parsed.content) > self.content_sent:
            content = parsed.content[self.content_sent:]
            self.content_sent = len(parsed.content)
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.calls):
            if index >= len(self.calls):
                sent = _SentCall(self.parser.new_call_id(), call.name)
                self.calls.append(sent)
                deltas.append({"index": index, "id": sent.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self.calls[index]
            if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(sent.arguments):
                fragment = call.arguments[len(sent.arguments):]
                sent.arguments = call.arguments
                deltas.append({"index": index, "function": {"arguments": fragment}})
        return content, deltas
