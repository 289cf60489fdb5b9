"""Stream chunks written from a template (``TextChunkFrames``) are the frames the pydantic models make."""

from __future__ import annotations

import json

import pytest

from nxdserve.api.responses import (
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from nxdserve.api.streaming import TextChunkFrames, sse_frame

TEXTS = ["", " Paris", 'a "quoted" \\ back\\slash', "line\nbreak\ttab\r", "ünï 中文 🚀", "\x00\x1b\x7f", "</script>"]
Stop = int | str | None
ENDINGS: list[tuple[str | None, Stop]] = [(None, None), ("stop", None), ("stop", 2), ("stop", "\n\n"), ("length", None)]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(("finish_reason", "stop_reason"), ENDINGS)
def test_completion_frames_equal_the_models(text: str, finish_reason: str | None, stop_reason: Stop) -> None:
    fast = TextChunkFrames('cmpl-1"x', "text_completion", 1700000000, "Smol/LM é", chat=False)
    choice = CompletionChoice(index=3, text=text, logprobs=None, finish_reason=finish_reason, stop_reason=stop_reason)
    model = CompletionStreamResponse(id='cmpl-1"x', created=1700000000, model="Smol/LM é", choices=[choice])
    _assert_same(fast.frame(3, text, finish_reason, stop_reason), sse_frame(model))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(("finish_reason", "stop_reason"), ENDINGS)
def test_chat_frames_equal_the_models(text: str, finish_reason: str | None, stop_reason: Stop) -> None:
    fast = TextChunkFrames("chatcmpl-7", "chat.completion.chunk", 1700000001, "m", chat=True)
    choice = ChatStreamChoice(
        index=0, delta=DeltaMessage(content=text), logprobs=None, finish_reason=finish_reason, stop_reason=stop_reason
    )
    model = ChatCompletionStreamResponse(id="chatcmpl-7", created=1700000001, model="m", choices=[choice])
    _assert_same(fast.frame(0, text, finish_reason, stop_reason), sse_frame(model))


def _assert_same(fast: str, reference: str) -> None:
    assert fast.startswith("data: ") and fast.endswith("\n\n")
    assert json.loads(fast[6:])["choices"][0]["logprobs"] is None
    assert fast == reference  # byte for byte, escapes included
