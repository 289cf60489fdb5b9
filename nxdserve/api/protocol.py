"""Request models for the OpenAI-compatible endpoints, with vLLM's extra sampling fields.

Pydantic checks types and the few bounds vLLM puts in the schema (seed within int64); range checks
on sampling values are SamplingParams.validate's, so the engine and the API say the same thing.
Unknown fields parse (``extra="allow"``) so that ``params.check_common`` can name them in a 400: vLLM accepts
and logs them, OpenAI refuses them, and a field nxdserve would ignore must not look honoured.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

TokenIds = list[int]
CompletionPrompt = str | list[str] | TokenIds | list[TokenIds]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # parsed; the schema is always enforced (vLLM)


class ResponseFormat(OpenAIModel):
    type: str = "text"  # text | json_object | json_schema | structural_tag
    json_schema: JsonSchemaFormat | None = None
    # type structural_tag (vLLM)
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class SamplingRequest(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    # None: take the model's generation_config.json default, else vLLM's.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    use_beam_search: bool = False
    user: str | None = None
    # Structured outputs (nxdserve.api.structured): vLLM's field and its older guided_* names.
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's other sampling extras (issue 27 item 5: each works or is a 400 naming it)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = 0
    request_id: str | None = None  # vLLM's: the response id's suffix (an X-Request-Id header wins)


class CompletionRequest(SamplingRequest):
    prompt: CompletionPrompt | None = None
    max_tokens: int | None = None  # None: 16 (OpenAI's and vLLM's completions default)
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class TextPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # takes precedence over the deprecated max_tokens
    max_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False


class TokenizeRequest(OpenAIModel):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


RequestKind = Literal["completion", "chat"]
