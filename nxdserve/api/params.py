"""From a validated request model to engine inputs: checks the schema cannot express, the
SamplingParams with generation-config defaults applied, and the bound on choices (the fan-out: engine/choices.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nxdserve.api.errors import APIError, raise_with_request_names
from nxdserve.api.protocol import (
    ChatCompletionRequest,
    CompletionPrompt,
    CompletionRequest,
    OpenAIModel,
    SamplingRequest,
)
from nxdserve.api.structured import structured_outputs_of
from nxdserve.engine.choices import MAX_CHOICES
from nxdserve.errors import InvalidRequestError
from nxdserve.sampling_params import OutputKind, SamplingParams
from nxdserve.tools.flags import check_chat_template_flags

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
# Each choice is one engine request; bound the fan-out so one request cannot flood the queue.
EMPTY_PROMPT_MESSAGE = "Either prompt or prompt_embeds must be provided and non-empty."
# vLLM's _DEFAULT_SAMPLING_PARAMS: used when neither the request nor generation_config.json sets one.
_VLLM_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}

PromptInput = str | list[int]


# vLLM and OpenAI request fields nxdserve does not implement: a request that sets one gets a 400 naming it, never
# a silent no-op (fields OpenAI's SDK sends by default are not here). ``echo`` and ``prompt_logprobs`` reach this
# list only on chat (completions implement both).
UNSUPPORTED_FIELDS = ("logits_processors", "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs", "documents",
                      "length_penalty", "prompt_embeds", "prediction", "audio", "functions", "function_call",
                      "reasoning_effort", "web_search_options", "cache_salt", "media_io_kwargs", "echo",
                      "prompt_logprobs", "return_token_ids", "logprob_token_ids", "truncation_side",
                      "repetition_detection", "verbosity", "thinking_token_budget")

# OpenAI fields that ask nothing of a server without storage or tiers, accepted with the values that mean just
# that (None: any value, the field being a label or hint only); another value is a 400 naming the field.
NO_OP_FIELDS: dict[str, tuple[Any, ...] | None] = {
    "store": (None, False),  # OpenAI keeps the completion for its dashboard: nothing is stored here
    "metadata": None,  # labels for stored completions
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "prompt_cache_key": None,  # a routing hint for OpenAI's cache; prefix caching here matches by content
    "safety_identifier": None,  # an end-user id for abuse monitoring, like ``user``
    "include_reasoning": (None, True),  # vLLM's default: reasoning_content is returned (--reasoning-parser)
}


def refuse_extra_fields(req: OpenAIModel) -> None:
    """/tokenize and /detokenize: every field they do not declare is a 400 naming it."""
    for name in req.model_extra or {}:
        known = name in UNSUPPORTED_FIELDS or name in ("chat_template", "mm_processor_kwargs")
        reason = "is not supported by this server." if known else "is not a field of this endpoint."
        raise APIError(f"Unrecognized request argument supplied: {name}: it {reason}", param=name)


def check_common(req: SamplingRequest) -> None:
    """vLLM's request-level checks shared by both generation endpoints."""
    extra = req.model_extra or {}
    for name, value in extra.items():
        if name in UNSUPPORTED_FIELDS:
            if not (value is None or value is False or value in ([], {}, "")):  # set to something
                raise APIError(f"{name} is not supported by this server.", param=name)
            continue
        if name not in NO_OP_FIELDS:
            raise APIError(f"Unrecognized request argument supplied: {name}", param=name)
        allowed = NO_OP_FIELDS[name]
        if allowed is not None and value not in allowed:
            raise APIError(f"{name} = {value!r} is not supported by this server.", param=name)
    _refuse_nested_extras(req)
    if req.stream_options is not None and not req.stream:
        raise APIError("Stream options can only be defined when `stream=True`.", param="stream_options")
    if req.use_beam_search:
        raise APIError("Beam search is not supported.", param="use_beam_search")
    if req.n < 1:
        raise APIError(f"n must be at least 1, got {req.n}.", param="n")


def _refuse_nested_extras(req: SamplingRequest) -> None:
    """Unknown keys inside response_format (and its json_schema) and stream_options: a 400 naming them, as OpenAI
    gives, rather than a constraint silently looser than asked (a misplaced ``schema`` would be dropped)."""
    fmt = req.response_format
    nested: list[tuple[str, str, OpenAIModel | None]] = [
        ("response_format", "response_format", fmt),
        ("response_format", "response_format.json_schema", fmt.json_schema if fmt is not None else None),
        ("stream_options", "stream_options", req.stream_options),
    ]
    for param, path, model in nested:
        for name in (model.model_extra or {}) if model is not None else {}:
            raise APIError(f"Unrecognized request argument supplied: {path}.{name}", param=param)


def check_completion(req: CompletionRequest) -> None:
    check_common(req)
    if req.suffix is not None:
        raise APIError("suffix is not currently supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of is not supported; it must be unset or equal to n.", param="best_of")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    if req.max_tokens is not None and req.max_tokens < 0:
        raise APIError(f"max_tokens must be at least 0, got {req.max_tokens}.", param="max_tokens")


def check_chat(req: ChatCompletionRequest) -> None:
    check_common(req)
    if not req.messages:
        raise APIError("messages must contain at least one message.", param="messages")
    check_chat_template_flags(req.add_generation_prompt, req.continue_final_message)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    if req.chat_template is not None:
        raise APIError("A per-request chat_template is not supported.", param="chat_template")


def normalize_prompts(prompt: CompletionPrompt | None, vocab_size: int) -> list[PromptInput]:
    """A completion prompt in any of its four shapes, as a list of engine prompts."""
    if prompt is None or (isinstance(prompt, str | list) and len(prompt) == 0):
        raise APIError(EMPTY_PROMPT_MESSAGE, param="prompt")
    if isinstance(prompt, str):
        prompts: list[PromptInput] = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [[int(p) for p in prompt if isinstance(p, int)]]
    else:
        prompts = [p if isinstance(p, str) else list(p) for p in prompt if not isinstance(p, int)]
    for p in prompts:
        if len(p) == 0:
            raise APIError(EMPTY_PROMPT_MESSAGE, param="prompt")
        if isinstance(p, list):
            check_token_ids(p, vocab_size, param="prompt")
    return prompts


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    for tid in token_ids:
        if not 0 <= tid < vocab_size:
            raise APIError(f"Token id {tid} is out of vocabulary (vocab size {vocab_size}).", param=param)


def _logit_bias(raw: Mapping[str, float] | None) -> dict[int, float] | None:
    if not raw:
        return None
    try:
        return {int(k): float(v) for k, v in raw.items()}
    except ValueError as exc:
        raise APIError(f"logit_bias keys must be token ids: {exc}", param="logit_bias") from exc


def _pick(name: str, value: Any, defaults: Mapping[str, float | int]) -> Any:
    return value if value is not None else defaults.get(name, _VLLM_DEFAULTS[name])


def build_sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    defaults: Mapping[str, float | int],
    vocab_size: int,
    max_logprobs: int,
) -> SamplingParams:
    """The request's SamplingParams (n as requested), validated. Raises InvalidRequestError."""
    if isinstance(req, CompletionRequest):
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = int(defaults.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS))
        elif max_tokens == 0 and req.echo:
            max_tokens = 1  # vLLM: echo with max_tokens=0 generates one token and drops it
        logprobs = req.logprobs
        # echo returns the prompt's tokens too, so their logprobs come with it (vLLM's rule).
        prompt_logprobs = req.prompt_logprobs
        if req.echo and logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = logprobs
    else:
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None and "max_tokens" in defaults:
            max_tokens = int(defaults["max_tokens"])
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        n=req.n,
        temperature=_pick("temperature", req.temperature, defaults),
        top_p=_pick("top_p", req.top_p, defaults),
        top_k=_pick("top_k", req.top_k, defaults),
        min_p=_pick("min_p", req.min_p, defaults),
        repetition_penalty=_pick("repetition_penalty", req.repetition_penalty, defaults),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=_logit_bias(req.logit_bias),
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        structured_outputs=structured_outputs_of(req),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        output_kind=OutputKind.DELTA,  # the API layer gathers and streams deltas
    )
    try:
        params.validate(vocab_size=vocab_size, max_logprobs=max_logprobs)
    except InvalidRequestError as exc:
        if not isinstance(req, ChatCompletionRequest):
            raise
        names = {"logprobs": "top_logprobs", **chat_field_names(req)}  # chat's top_logprobs is logprobs there
        raise_with_request_names(exc, names, names)
    return params


def chat_field_names(req: ChatCompletionRequest) -> dict[str, str]:
    """SamplingParams' or the engine's field names -> the ones this chat request sent (errors name those)."""
    return {"max_tokens": "max_completion_tokens"} if req.max_completion_tokens is not None else {}


def check_fan_out(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise APIError(
            f"A request may ask for at most {MAX_CHOICES} choices (prompts x n); got {num_prompts} x {n}.",
            param="n" if n > 1 else "prompt",
        )
