"""Incremental detokenization and stop strings, the way vLLM's front end does them."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenizers.decoders import DecodeStream

# DecodeStream needs some prompt context so the first output token gets its leading space right.
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns output token ids into text, correct across multi-byte characters split over tokens."""

    def __init__(self, backend_tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = backend_tokenizer
        self._context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(ids=self._context, skip_special_tokens=skip_special_tokens)
        self._token_ids: list[int] = []
        self.text = ""

    def add(self, token_ids: list[int]) -> int:
        """Decode new tokens; returns how many characters were added to ``text``."""
        before = len(self.text)
        self._token_ids.extend(token_ids)
        for token_id in token_ids:
            piece = self._stream.step(self._tokenizer, token_id)
            if piece:
                self.text += piece
        return len(self.text) - before

    def flush(self) -> int:
        """At the end of a request: add the text the stream still holds back. DecodeStream waits while the
        text ends in U+FFFD (the bytes of a character split over tokens), so tokens that ARE the
        replacement character, or a sequence cut off by the length limit, would otherwise never appear
        (e.g. a greedy loop on such a token ended with empty text). Returns the characters added."""
        decode = self._tokenizer.decode
        context = decode(self._context, skip_special_tokens=self._skip_special_tokens)
        full = decode(self._context + self._token_ids, skip_special_tokens=self._skip_special_tokens)
        if not full.startswith(context):
            return 0
        tail = full[len(context) :]
        if len(tail) <= len(self.text) or not tail.startswith(self.text):
            return 0
        added = len(tail) - len(self.text)
        self.text = tail
        return added


def find_stop_string(text: str, num_new_chars: int, stop: list[str]) -> tuple[str, int] | None:
    """Earliest stop string that ends inside the newly added characters: (string, start index)."""
    best: tuple[str, int] | None = None
    for s in stop:
        # A match must overlap the new characters, so search only the tail that could contain it.
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (s, idx)
    return best


class TokenTextCache:
    """Per-token display strings for logprobs (vLLM: convert_ids_to_tokens + tokens_to_string)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.decode = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        if token is None:
            return ""
        return str(self._tokenizer.convert_tokens_to_string([token]))
