"""Argument types with vLLM's spellings: human-readable sizes, JSON values, "None" as no value."""

from __future__ import annotations

import argparse
import json
from typing import Any

_UNITS = {
    "k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2, "g": 1000**3, "G": 1024**3, "t": 1000**4, "T": 1024**4,
}  # fmt: skip


def size(text: str) -> int:
    """An integer, or vLLM's human forms: 4k = 4000, 4K = 4096, 1m = 10**6, 1M = 2**20, 2G = 2 * 2**30."""
    try:
        if text and text[-1] in _UNITS:
            return int(float(text[:-1]) * _UNITS[text[-1]])
        return int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from exc


def json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc


def json_object(text: str) -> dict[str, Any]:
    value = json_value(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def json_list(text: str) -> list[str]:
    """vLLM's CORS lists: a JSON list such as '["https://a.example"]'; a bare word is taken as a one-item list."""
    try:
        value = json.loads(text)
    except ValueError:
        return [text]
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError('must be a JSON list of strings, e.g. \'["*"]\'')
    return value


def nullable_str(text: str) -> str | None:
    return None if not text or text == "None" else text


def nullable_int(text: str) -> int | None:
    return None if not text or text == "None" else size(text)
