"""The Responses API's server-sent events, each ``event: <type>`` + ``data: <json>`` with a rising
``sequence_number`` (OpenAI's framing; the SDK reads the type from the data)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from nxdserve.api.errors import APIError
from nxdserve.api.responses_api.protocol import OutputMessage, OutputText, ResponseObject


class EventWriter:
    def __init__(self, skeleton: ResponseObject, message_id: str) -> None:
        self.skeleton = skeleton
        self.message_id = message_id
        self.sequence_number = 0
        self._where = {"item_id": message_id, "output_index": 0, "content_index": 0}

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def opening(self) -> Iterator[str]:
        response = self.skeleton.model_dump(mode="json")
        yield self.event("response.created", response=response)
        yield self.event("response.in_progress", response=response)
        item = OutputMessage(id=self.message_id, status="in_progress").model_dump(mode="json")
        yield self.event("response.output_item.added", output_index=0, item=item)
        part = OutputText(text="").model_dump(mode="json")
        yield self.event("response.content_part.added", **self._where, part=part)

    def delta(self, text: str) -> str:
        return self.event("response.output_text.delta", **self._where, delta=text, logprobs=[])

    def closing(self, final: ResponseObject) -> Iterator[str]:
        message = final.output[0]
        part = message.content[0]
        yield self.event("response.output_text.done", **self._where, text=part.text, logprobs=[])
        yield self.event("response.content_part.done", **self._where, part=part.model_dump(mode="json"))
        yield self.event("response.output_item.done", output_index=0, item=message.model_dump(mode="json"))
        kind = "response.completed" if final.status == "completed" else "response.incomplete"
        yield self.event(kind, response=final.model_dump(mode="json"))

    def error(self, err: APIError) -> str:
        return self.event("error", code=str(err.status), message=err.message, param=err.param)
