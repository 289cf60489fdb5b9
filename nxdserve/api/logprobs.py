"""Engine logprobs (one ``{token_id: Logprob}`` per token, the chosen token first) in the two
OpenAI shapes: the legacy completions object and chat's ``content`` list."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from nxdserve.api.responses import ChatLogProbs, ChatTokenLogprob, ChatTopLogprob, CompletionLogProbs
from nxdserve.engine.outputs import Logprob

# vLLM clamps -inf (a token masked out by top-k/top-p) so the JSON stays valid.
_MIN_LOGPROB = -9999.0


def _value(lp: Logprob) -> float:
    value = lp.logprob
    return _MIN_LOGPROB if math.isnan(value) else max(value, _MIN_LOGPROB)


class TokenIdNames:
    """``return_tokens_as_token_ids``: logprobs name each token ``token_id:{id}`` (vLLM's form), for clients that
    need tokens that are not valid UTF-8 on their own. Passed where the tokenizer would be."""


def token_text(tokenizer: Any, token_id: int, lp: Logprob | None) -> str:
    if isinstance(tokenizer, TokenIdNames):
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob] | None],
    num_top: int,
    tokenizer: Any,
    initial_offset: int = 0,
) -> CompletionLogProbs:
    """The legacy shape. ``top_logprobs`` holds the chosen token plus the top ``num_top`` (so up to
    num_top + 1 entries, as OpenAI's spec and vLLM do). A ``None`` step (the first prompt token)
    has no logprob."""
    # Explicit lists: streams serialise with exclude_unset, which would drop defaulted fields.
    out = CompletionLogProbs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    offset = initial_offset
    for token_id, step in zip(token_ids, logprobs, strict=False):
        chosen = step.get(token_id) if step else None
        token = token_text(tokenizer, token_id, chosen)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if step is None or chosen is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_value(chosen))
        top: dict[str, float] = {}
        for i, (tid, lp) in enumerate(step.items()):
            if i > num_top:
                break
            top[token_text(tokenizer, tid, lp)] = _value(lp)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob]],
    num_top: int,
    tokenizer: Any,
) -> ChatLogProbs:
    """Chat's shape: per token its logprob and bytes, and exactly the ``num_top`` best alternatives
    by rank (the chosen token among them only if it ranks there)."""
    content = []
    for token_id, step in zip(token_ids, logprobs, strict=False):
        chosen = step.get(token_id)
        token = token_text(tokenizer, token_id, chosen)
        top: list[ChatTopLogprob] = []
        if num_top > 0:
            ranked = sorted(step.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
            for tid, lp in ranked[:num_top]:
                text = token_text(tokenizer, tid, lp)
                top.append(ChatTopLogprob(token=text, logprob=_value(lp), bytes=list(text.encode())))
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=_value(chosen) if chosen is not None else _MIN_LOGPROB,
                bytes=list(token.encode()),
                top_logprobs=top,
            )
        )
    return ChatLogProbs(content=content)
