"""Reasoning parsers: the thinking of ``<think>...</think>`` models goes to ``reasoning_content``, the rest is
content (vLLM 0.11's ``deepseek_r1`` and ``qwen3``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nxdserve.tools.base import held_back

START, END = "<think>", "</think>"


class ReasoningParser:
    name: ClassVar[str] = ""
    start: ClassVar[str] = START
    end: ClassVar[str] = END

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of the text so far; while streaming, a possible partial tag is held back."""
        raise NotImplementedError

    def prompt_ends_reasoning(self, prompt: str) -> bool:
        """The template already closed the thinking (e.g. Qwen3 with enable_thinking false): the answer starts at
        the first output token, and so does a structured-outputs constraint."""
        return prompt.rfind(self.end) > prompt.rfind(self.start) >= 0


class DeepSeekR1ReasoningParser(ReasoningParser):
    """Everything before ``</think>`` is reasoning (the template may have emitted ``<think>`` itself); without
    ``</think>`` the whole output is reasoning."""

    name = "deepseek_r1"

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        body = text[len(self.start):] if text.startswith(self.start) else text
        if not final and self.start.startswith(text) and text:
            return None, None
        end = body.find(self.end)
        if end < 0:
            keep = len(body) - (0 if final else held_back(body, self.end))
            return body[:keep] or None, None
        return body[:end] or None, body[end + len(self.end):] or None


class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning only when both tags are in the output; otherwise everything is content."""

    name = "qwen3"

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        stripped = text.lstrip()
        if not stripped.startswith(self.start):
            if not final and self.start.startswith(stripped):
                return None, None
            return None, text or None
        body = stripped[len(self.start):]
        end = body.find(self.end)
        if end < 0:
            if final:
                return None, text  # no closing tag: content, as vLLM 0.11's qwen3 parser
            return body[: len(body) - held_back(body, self.end)] or None, None
        return body[:end] or None, body[end + len(self.end):] or None


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise KeyError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()


@dataclass
class ReasoningStreamer:
    parser: ReasoningParser
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) for the new text. Qwen3's final decision may turn streamed reasoning
        into content; then the content delta repeats it (vLLM streams it the same way)."""
        self.text += delta
        reasoning, content = self.parser.split(self.text, final)
        r, c = reasoning or "", content or ""
        r_delta = r[self.reasoning_sent:] if len(r) > self.reasoning_sent else ""
        c_delta = c[self.content_sent:] if len(c) > self.content_sent else ""
        self.reasoning_sent = max(self.reasoning_sent, len(r))
        self.content_sent = max(self.content_sent, len(c))
        return r_delta, c_delta
