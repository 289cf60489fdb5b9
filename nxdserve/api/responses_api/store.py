"""Stored responses for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``: in memory, bounded,
least recently used first out (vLLM keeps them in memory too; nothing survives a restart)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from nxdserve.api.responses_api.protocol import ResponseObject

DEFAULT_MAX_STORED = 1024


@dataclass
class StoredResponse:
    response: ResponseObject
    # The conversation as chat messages, this response's output included: what a follow-up continues.
    messages: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_STORED) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
