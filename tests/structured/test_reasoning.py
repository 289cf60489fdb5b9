"""Reasoning parsers (deepseek_r1, qwen3) on recorded outputs, streamed and not; structured outputs start after the
thinking ends."""

from __future__ import annotations

import pytest

from nxdserve.api.chat_output import ChatOutputPlan
from nxdserve.engine.structured import StructuredOutputsParams
from nxdserve.sampling_params import SamplingParams
from nxdserve.tools.reasoning import ReasoningStreamer, get_reasoning_parser
from tests.helpers.engine import run_to_completion, shared_core, tokenize

R1 = "Let me think about Paris.\nIt is in France.</think>\n\nParis is the capital."
QWEN3 = "<think>\nThe user asks for JSON.\n</think>\n\n{\"a\": 1}"


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), [
    ("deepseek_r1", R1, "Let me think about Paris.\nIt is in France.", "\n\nParis is the capital."),
    ("deepseek_r1", "<think>short</think>ok", "short", "ok"),
    ("deepseek_r1", "still thinking", "still thinking", None),  # no end tag: all reasoning
    ("qwen3", QWEN3, "\nThe user asks for JSON.\n", '\n\n{"a": 1}'),
    ("qwen3", "no tags at all", None, "no tags at all"),
    ("qwen3", "<think>unfinished", None, "<think>unfinished"),  # both tags needed (vLLM 0.11)
])
def test_split_and_stream(name: str, text: str, reasoning: str | None, content: str | None) -> None:
    parser = get_reasoning_parser(name)
    assert parser.split(text, final=True) == (reasoning, content)
    if name == "qwen3" and reasoning is None:
        return  # a qwen3 stream only knows at the end that there was no reasoning
    streamer = ReasoningStreamer(parser)
    got_r, got_c = "", ""
    for i in range(0, len(text), 3):
        r, c = streamer.feed(text[i: i + 3], final=i + 3 >= len(text))
        got_r, got_c = got_r + r, got_c + c
    assert (got_r or None, got_c or None) == (reasoning, content)


def test_prompt_that_closed_the_thinking() -> None:
    parser = get_reasoning_parser("qwen3")
    assert parser.prompt_ends_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not parser.prompt_ends_reasoning("<|im_start|>assistant\n<think>\n")


def test_chat_plan_puts_thinking_into_reasoning_content() -> None:
    class Config:
        reasoning_parser = "deepseek_r1"

    from nxdserve.api.protocol import ChatCompletionRequest

    plan = ChatOutputPlan.build(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]), Config())
    assert plan.message(R1) == ("\n\nParis is the capital.", "Let me think about Paris.\nIt is in France.", [])
    streamer = plan.streamer()
    pieces = [streamer.feed(R1[i: i + 5], final=i + 5 >= len(R1)) for i in range(0, len(R1), 5)]
    assert "".join(p[0] for p in pieces) == "Let me think about Paris.\nIt is in France."
    assert "".join(p[1] for p in pieces) == "\n\nParis is the capital."


def test_constraint_starts_after_the_end_of_thinking() -> None:
    """The grammar applies only once the marker tokens appear: the tokens up to them are the model's own."""
    core = shared_core()
    prompt = tokenize(core, ["The capital of France is"])
    free = run_to_completion(core, prompt, SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].token_ids
    marker = tuple(free[1:3])  # stands in for </think>: the model writes it by itself at step 2-3
    spec = StructuredOutputsParams(choice=["ALPHA", "BETA"], start_after_token_ids=marker)
    out = run_to_completion(core, prompt, SamplingParams(temperature=0.0, max_tokens=20,
                                                         structured_outputs=spec))[0].outputs[0]
    assert out.token_ids[:3] == free[:3]
    answer = core.tokenizer.decode(out.token_ids[3:], skip_special_tokens=True)
    assert answer in ("ALPHA", "BETA")
