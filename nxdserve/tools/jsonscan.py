"""Locating the members of a JSON object in text that may still be growing (a stream), without parsing it.

Streaming needs the raw text of a call's arguments as it arrives: any prefix of it stays a prefix once more text
comes, so fragments sent early concatenate to exactly the final arguments string.
"""

from __future__ import annotations

import json

WHITESPACE = " \t\r\n"


class MalformedJSON(ValueError):
    pass


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def skip_string(text: str, i: int) -> int | None:
    """Index after the string starting at ``text[i] == '"'``; None when it has not ended yet."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def skip_value(text: str, i: int) -> int | None:
    """Index after the JSON value starting at ``i``; None when the text ends inside it."""
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        return skip_string(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < n:
            ch = text[j]
            if ch == '"':
                end = skip_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < n and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < n else None  # a number at the end may still grow


Span = tuple[int, int | None]  # (start, end); end None: the value has not ended yet


def scan_object(text: str, i: int) -> tuple[dict[str, Span], int | None]:
    """The top-level members of the object starting at ``text[i] == '{'`` as key -> value span, and the index
    after the object (None while it is incomplete). Raises MalformedJSON where the text cannot be JSON."""
    members: dict[str, Span] = {}
    n = len(text)
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= n:
            return members, None
        if text[j] == "}":
            return members, j + 1
        if text[j] == ",":
            j += 1
            continue
        if text[j] != '"':
            raise MalformedJSON(f"expected a key at {j}")
        key_end = skip_string(text, j)
        if key_end is None:
            return members, None
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= n:
            return members, None
        if text[j] != ":":
            raise MalformedJSON(f"expected ':' at {j}")
        start = skip_ws(text, j + 1)
        end = skip_value(text, start) if start < n else None
        members[key] = (start, end)
        if end is None:
            return members, None
        j = end
