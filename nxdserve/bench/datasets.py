"""Synthetic, token-exact benchmark datasets built locally with the server's tokenizer (no downloads).

Every generator returns ``SampleRequest``s whose ``prompt`` re-encodes (without special tokens) to exactly
``prompt_len`` tokens, the way ``vllm bench serve`` builds its random prompts: produce token ids, decode,
re-encode, and pad or truncate until the count is stable.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nxdserve.bench.tokenizer import BenchTokenizer

logger = logging.getLogger(__name__)

DATASET_NAMES = ("random", "sharegpt-like", "prefix-repetition")


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int
    request_id: str = ""
    group: str = ""  # a workload label (e.g. "short" / "long" in a mixed load); metrics can be split by it


def allowed_token_ids(tokenizer: BenchTokenizer) -> np.ndarray:
    """All ids below ``vocab_size`` except special tokens: those decode to markup that re-encodes oddly."""
    ids = np.arange(tokenizer.vocab_size)
    special = np.fromiter(tokenizer.special_ids, dtype=np.int64) if tokenizer.special_ids else None
    return ids if special is None else np.setdiff1d(ids, special)


def padding_pool(
    tokenizer: BenchTokenizer, allowed: np.ndarray, seed: int = 0, want: int = 32, max_probe: int = 512
) -> np.ndarray:
    """Ids that survive a round trip alone: decode to clean text (no U+FFFD) that re-encodes to themselves.

    Padding with a raw byte token (half of a UTF-8 character) makes the decode/re-encode loop oscillate;
    padding with these settles it. A seeded sample is probed, so a server-side tokenizer costs few calls.
    """
    rng = np.random.default_rng(seed)
    pool: list[int] = []
    for t in rng.permutation(allowed)[:max_probe].tolist():
        text = tokenizer.decode([t])
        if text.strip() and "\ufffd" not in text and tokenizer.encode(text) == [t]:
            pool.append(t)
            if len(pool) >= want:
                break
    return np.asarray(pool) if pool else allowed


def decode_to_target_len(
    tokenizer: BenchTokenizer,
    token_ids: Sequence[int],
    target_len: int,
    rng: np.random.Generator,
    pad_ids: np.ndarray,
    max_retry: int = 10,
) -> tuple[str, list[int], int]:
    """Decode ``token_ids`` to text whose re-encoding has ``target_len`` tokens.

    N ids do not always decode to text that re-encodes to N ids (BPE merges across the joins, partial UTF-8
    bytes become U+FFFD), so iterate: decode, re-encode, then truncate or pad with random ``pad_ids``.
    Returns (text, its ids, mismatch); the mismatch is non-zero only if ``max_retry`` rounds did not settle.
    """
    ids = list(token_ids)
    for attempt in range(max_retry + 1):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        mismatch = len(ids) - target_len
        # Stop on the final round without adjusting, so text, ids and mismatch stay consistent.
        if mismatch == 0 or attempt == max_retry:
            return text, ids, mismatch
        # Cutting inside a multi-byte character re-creates the overshoot, so each later round cuts one
        # token deeper and lets the next round pad the gap with clean ids.
        cut = max(target_len - attempt, 0)
        ids = ids[:cut] if mismatch > 0 else ids + rng.choice(pad_ids, size=-mismatch).tolist()
    raise AssertionError("unreachable")


def _sampling_bounds(mean_len: int, range_ratio: float, minimum: int) -> tuple[int, int]:
    low = max(math.floor(mean_len * (1 - range_ratio)), minimum)
    high = max(math.ceil(mean_len * (1 + range_ratio)), minimum)
    return low, high


def random_dataset(
    tokenizer: BenchTokenizer,
    num_prompts: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """vLLM's ``random`` dataset: lengths uniform in [len*(1-r), len*(1+r)], ids (offset + i + arange) % V.

    The input length counts the special tokens the server adds (e.g. BOS), as vLLM does, so the server sees
    ``input_len`` tokens in total; ``prompt_len`` is the text's own length plus the shared prefix.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1).")
    rng = np.random.default_rng(seed)
    real_input_len = max(0, input_len - tokenizer.num_special_tokens_to_add())
    in_low, in_high = _sampling_bounds(real_input_len, range_ratio, 0)
    out_low, out_high = _sampling_bounds(output_len, range_ratio, 1)
    if prefix_len + in_low < 1:
        raise ValueError(
            f"--random-input-len {input_len} is too small: with {tokenizer.num_special_tokens_to_add()} special "
            f"tokens and range ratio {range_ratio}, a prompt could be empty."
        )
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_prompts)
    allowed = allowed_token_ids(tokenizer)
    pad = padding_pool(tokenizer, allowed, seed)
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len > 0 else []

    requests: list[SampleRequest] = []
    mismatch_total = 0
    for i in range(num_prompts):
        inner = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(allowed)].tolist()
        target = prefix_len + int(input_lens[i])
        text, ids, mismatch = decode_to_target_len(tokenizer, prefix + inner, target, rng, pad)
        mismatch_total += mismatch
        requests.append(SampleRequest(text, len(ids), int(output_lens[i]), request_id=f"random-{i}"))
    _warn_mismatch(mismatch_total)
    return requests


# ShareGPT after vLLM's pruning has prompts of a few to ~1000 tokens (median around a hundred) and replies
# of similar spread but longer on average; two lognormals reproduce that mix without the 600 MB download.
SHAREGPT_PROMPT_MEDIAN = 110.0
SHAREGPT_PROMPT_SIGMA = 1.0
SHAREGPT_OUTPUT_MEDIAN = 160.0
SHAREGPT_OUTPUT_SIGMA = 0.9

# Filler vocabulary for English-like prompts (kept as text: one word per line would be 230 lines).
_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has look two more "
    "write go see number no way could people my than first water been call who oil its now find long down "
    "day did get come made may part over new sound take only little work know place year live me back "
    "give most very after thing our just name good sentence man think say great where help through much "
    "before line right too mean old any same tell boy follow came want show also around form three small "
    "set put end does another well large must big even such because turn here why ask went men read need "
    "land different home us move try kind hand picture again change off play spell air away animal house "
    "point page letter mother answer found study still learn should America world explain python function "
    "error server model request memory latency token cache budget schedule prompt output "
)
_WORDS = tuple(_WORD_TEXT.split())


def is_valid_sharegpt_pair(
    prompt_len: int, output_len: int, min_len: int = 4, max_prompt_len: int = 1024, max_total_len: int = 2048
) -> bool:
    """vLLM's pruning rule for ShareGPT conversations (``is_valid_sequence``)."""
    return (
        prompt_len >= min_len
        and output_len >= min_len
        and prompt_len <= max_prompt_len
        and prompt_len + output_len <= max_total_len
    )


def _synthetic_text(rng: np.random.Generator, num_words: int) -> str:
    words = rng.choice(_WORDS, size=max(num_words, 1))
    out: list[str] = []
    sentence_left = 0
    for w in words:
        if sentence_left == 0:
            sentence_left = int(rng.integers(5, 18))
            w = w.capitalize()
        sentence_left -= 1
        out.append(w + ("." if sentence_left == 0 else ""))
    return " ".join(out)


def sharegpt_like_dataset(
    tokenizer: BenchTokenizer,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[SampleRequest]:
    """Prompt/output lengths drawn from lognormals, kept only if they pass vLLM's ShareGPT pruning rule.

    ``output_len`` fixes every output length (vLLM's ``--sharegpt-output-len``). Prompts are English-like
    filler text trimmed to the exact token count.
    """
    rng = np.random.default_rng(seed)
    pad = padding_pool(tokenizer, allowed_token_ids(tokenizer), seed)
    requests: list[SampleRequest] = []
    mismatch_total = 0
    draws = 0
    while len(requests) < num_prompts:
        draws += 1
        if draws > 1000 * max(num_prompts, 1):
            raise ValueError("sharegpt-like: the length limits reject almost every draw; loosen them.")
        p_len = round(rng.lognormal(math.log(SHAREGPT_PROMPT_MEDIAN), SHAREGPT_PROMPT_SIGMA))
        o_len = output_len or round(rng.lognormal(math.log(SHAREGPT_OUTPUT_MEDIAN), SHAREGPT_OUTPUT_SIGMA))
        if not is_valid_sharegpt_pair(p_len, o_len, max_prompt_len=max_prompt_len, max_total_len=max_total_len):
            continue
        # About 1.3 tokens per English word; over-generate a little and trim in token space.
        ids = tokenizer.encode(_synthetic_text(rng, p_len))[:p_len]
        text, ids, mismatch = decode_to_target_len(tokenizer, ids, p_len, rng, pad)
        mismatch_total += mismatch
        requests.append(SampleRequest(text, len(ids), o_len, request_id=f"sharegpt-like-{len(requests)}"))
    _warn_mismatch(mismatch_total)
    return requests


def prefix_repetition_dataset(
    tokenizer: BenchTokenizer,
    num_prompts: int,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
    output_len: int = 128,
    seed: int = 0,
    max_join_retries: int = 20,
) -> list[SampleRequest]:
    """``num_prefixes`` shared prefixes of ``prefix_len`` tokens, each followed by a random suffix.

    Prompts are spread round-robin over the prefixes and shuffled. A suffix whose first token would merge
    with the prefix's last one is redrawn, so every prompt of a group starts with the very same prefix ids
    (what a prefix cache keys on) and has exactly ``prefix_len + suffix_len`` tokens.
    """
    if num_prefixes < 1 or num_prompts < num_prefixes:
        raise ValueError(f"num_prompts ({num_prompts}) must be at least num_prefixes ({num_prefixes}) >= 1.")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)
    pad = padding_pool(tokenizer, allowed, seed)

    def exact(length: int) -> tuple[str, list[int], int]:
        return decode_to_target_len(tokenizer, rng.choice(allowed, size=length).tolist(), length, rng, pad)

    prefixes = [exact(prefix_len) for _ in range(num_prefixes)]
    mismatch_total = sum(p[2] for p in prefixes)
    requests: list[SampleRequest] = []
    for i in range(num_prompts):
        group = i % num_prefixes
        prefix_text, prefix_ids, _ = prefixes[group]
        for _ in range(max_join_retries):
            suffix_text, _, mismatch = exact(suffix_len)
            ids = tokenizer.encode(prefix_text + suffix_text)
            if ids[: len(prefix_ids)] == prefix_ids and len(ids) == len(prefix_ids) + suffix_len:
                break
        mismatch_total += mismatch
        requests.append(
            SampleRequest(
                prefix_text + suffix_text, len(ids), output_len, request_id=f"prefix-{i}", group=f"prefix-{group}"
            )
        )
    order = rng.permutation(len(requests))
    _warn_mismatch(mismatch_total)
    return [requests[j] for j in order]


def _warn_mismatch(total: int) -> None:
    if total:
        logger.warning(
            "%d prompt token(s) %s than requested after decode/re-encode (the tokenizer did not settle).",
            abs(total),
            "more" if total > 0 else "fewer",
        )
