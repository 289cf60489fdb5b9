"""``n`` choices of one prompt: one single-sequence engine request per choice, their outputs merged.

The engine core runs single-sequence requests (a slot each); ``AsyncEngine.generate`` with ``n > 1`` starts
``n`` of them (``child_params``) and folds their outputs into the parent's (``ParentOutputs``), as vLLM's
``AsyncLLM.generate`` gives them: each ``CompletionOutput`` carries its choice's ``index``. The HTTP API fans out
the same way (``child_params``, ``merge``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from nxdserve.engine.outputs import CompletionOutput, RequestOutput
from nxdserve.sampling_params import INT64_MIN, OutputKind, SamplingParams

logger = logging.getLogger(__name__)

MAX_CHOICES = 256  # choices one request may ask for (prompts x n at the API): each holds a slot while it runs


def _wrap_int64(value: int) -> int:
    return (value - INT64_MIN) % 2**64 + INT64_MIN


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """One single-choice SamplingParams per choice; with a seed, child i gets seed + i (vLLM's rule), wrapped
    to int64."""
    if params.n == 1:
        return [params]
    return [
        dataclasses.replace(params, n=1, seed=None if params.seed is None else _wrap_int64(params.seed + i))
        for i in range(params.n)
    ]


class Stream(Protocol):
    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def abort(self) -> None: ...


def abort_all(streams: Sequence[Stream]) -> None:
    for stream in streams:
        try:
            stream.abort()
        except Exception:  # abort must never mask the error that brought us here
            logger.exception("abort failed")


async def merge(streams: Sequence[Stream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (choice index, output) from all streams as outputs arrive, until each has finished. However it
    ends (finished, closed early, an error), every stream is aborted: a no-op for a finished one."""
    try:
        if len(streams) == 1:  # the common case: no helper tasks
            async for out in streams[0]:
                yield 0, out
            return
        iterators = [s.__aiter__() for s in streams]
        pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.__getitem__):
                    i = pending.pop(task)
                    try:
                        out = task.result()
                    except StopAsyncIteration:
                        continue
                    yield i, out
                    if not out.finished:
                        pending[asyncio.ensure_future(anext(iterators[i]))] = i
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        abort_all(streams)


class ParentOutputs:
    """Folds the children's outputs into the parent request's, by output kind: DELTA passes each choice's
    delta (its index set); CUMULATIVE gives every choice's latest state; FINAL_ONLY one output with all
    choices, when the last finishes. The parent is finished when every choice is."""

    def __init__(self, request_id: str, n: int, kind: OutputKind) -> None:
        self.request_id = request_id
        self.n = n
        self.kind = kind
        self.latest: dict[int, CompletionOutput] = {}
        self.finished: set[int] = set()
        self.error: str | None = None

    def update(self, index: int, out: RequestOutput) -> RequestOutput | None:
        """The parent's output after choice ``index`` produced ``out``; None when there is nothing to give yet."""
        choice = dataclasses.replace(out.outputs[0], index=index)
        self.latest[index] = choice
        if out.finished:
            self.finished.add(index)
        self.error = self.error or out.error
        done = len(self.finished) == self.n
        if self.kind is OutputKind.FINAL_ONLY and not done:
            return None
        outputs = [choice] if self.kind is OutputKind.DELTA else [self.latest[i] for i in sorted(self.latest)]
        return dataclasses.replace(out, request_id=self.request_id, outputs=outputs, finished=done,
                                   error=self.error)  # fmt: skip
