"""The Responses API's request and response objects (OpenAI's ``POST /v1/responses``): text, function tools."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nxdserve.api.errors import APIError


class ResponsesRequest(BaseModel):
    """The fields served. Anything else a client sends is a 400 naming it (``check_supported``)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Function tools, flat ({"type": "function", "name", ...}); tools.py maps them onto chat's tool calling.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    # vLLM's extension: served earlier under --scheduling-policy priority; non-zero under fcfs is a 400.
    priority: int = 0


# Values that ask for nothing beyond plain text generation, so they pass.
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "truncation": (None, "disabled"),
    "include": (None, []),
    "background": (None, False),
    "reasoning": (None, {}),
    "service_tier": (None, "auto", "default"),
}


def check_supported(req: ResponsesRequest) -> None:
    """A 400 naming the first field this server cannot honour, so nothing is silently ignored. ``tools``,
    ``tool_choice`` and ``text`` are checked where they are mapped (tools.py)."""
    for name, allowed in _NO_OP_VALUES.items():
        if getattr(req, name) not in allowed:
            raise APIError(f"`{name}` = {getattr(req, name)!r} is not supported.", param=name)
    extra = sorted((req.model_extra or {}).keys())
    if extra:
        raise APIError(f"Unsupported field(s) for /v1/responses: {', '.join(extra)}.", param=extra[0])


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    """A parsed tool call (OpenAI's ResponseFunctionToolCall): ``call_id`` is what the client's
    ``function_call_output`` answers."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = ""  # JSON text of an object
    status: ItemStatus = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The thinking split off by ``--reasoning-parser`` (OpenAI's ResponseReasoningItem; no summary)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "completed"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0, "cache_write_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None

    @property
    def output_text(self) -> str:
        return "".join(part.text for item in self.output if isinstance(item, OutputMessage) for part in item.content)
