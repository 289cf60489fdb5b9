"""Per-request matchers: the bitmask of a step's constrained rows, and advancing on accepted tokens.

``fill`` runs in the engine's worker thread before the forward (``EngineCore.execute``); ``add``, ``advance`` and
``remove`` run between steps. A row with drafts gets one mask per verification position: llguidance advances the
matcher through the drafts and rolls it back, so a draft the grammar forbids cannot win verification and the
matcher's state is untouched until ``advance`` consumes the tokens actually accepted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.torch as lltorch
import numpy as np

from nxdserve.engine.structured.compiler import GrammarCompiler
from nxdserve.engine.structured.mask import StepTokenMask

if TYPE_CHECKING:
    from nxdserve.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass
class _RowGrammar:
    matcher: llguidance.LLMatcher
    start_after: tuple[int, ...] = ()
    started: bool = True
    recent: list[int] = field(default_factory=list)  # output tail, while waiting for ``start_after``


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, num_threads: int = 2) -> None:
        self.compiler = compiler
        self._rows: dict[str, _RowGrammar] = {}
        self._executor: llguidance.LLExecutor | None = None
        self._num_threads = num_threads
        self.mask_seconds = 0.0  # summed fill time, for the benchmark
        self.mask_steps = 0

    @property
    def active(self) -> bool:
        return bool(self._rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def add(self, request: Request) -> None:
        spec = request.params.structured_outputs
        if spec is None:
            return
        start_after = tuple(spec.start_after_token_ids)
        self._rows[request.request_id] = _RowGrammar(
            self.compiler.new_matcher(spec), start_after=start_after, started=not start_after
        )

    def remove(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._rows.pop(request_id, None)

    def fill(self, plan: Any, requests: Sequence[Request]) -> StepTokenMask | None:
        """The step's mask over constrained rows that sample (their drafts' positions included), or None. Drops
        draft alternatives of constrained rows: their extra token would be sampled without a mask."""
        entries: list[tuple[int, int, list[int]]] = []  # (plan row, first mask row, drafts)
        num_positions = 0
        for row, request in enumerate(requests):
            grammar = self._rows.get(request.request_id)
            if grammar is None or not grammar.started or not plan.sample[row]:
                continue
            drafts = [int(t) for t in request.spec_token_ids[: int(plan.num_drafts[row])]]
            entries.append((row, num_positions, drafts))
            num_positions += 1 + len(drafts)
        if not entries:
            return None
        t0 = time.perf_counter()
        bitmask = lltorch.allocate_token_bitmask(num_positions, self.compiler.vocab_size)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=self._num_threads)
        plain = [(self._rows[requests[r].request_id].matcher, first) for r, first, drafts in entries if not drafts]
        drafting = [(self._rows[requests[r].request_id].matcher, first, drafts) for r, first, drafts in entries
                    if drafts]
        if plain:
            lltorch.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafting:
            lltorch.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafting, bitmask)
        rows = np.concatenate([np.full(1 + len(d), r, dtype=np.int64) for r, _, d in entries])
        positions = np.concatenate([np.arange(1 + len(d), dtype=np.int64) for _, _, d in entries])
        if plan.draft_alternatives is not None:
            plan.draft_alternatives[[r for r, _, _ in entries]] = -1
        self.mask_seconds += time.perf_counter() - t0
        self.mask_steps += 1
        return StepTokenMask(rows=rows, positions=positions, bitmask=bitmask)

    def advance(self, updates: Sequence[Any]) -> None:
        """Consume each constrained request's accepted tokens (``RequestUpdate``s of a step)."""
        for update in updates:
            request_id = update.request.request_id
            grammar = self._rows.get(request_id)
            if grammar is None:
                continue
            if update.finished:
                del self._rows[request_id]
                continue
            for token in update.new_token_ids:
                if not grammar.started:
                    grammar.recent = [*grammar.recent, token][-len(grammar.start_after):]
                    grammar.started = tuple(grammar.recent) == grammar.start_after
                    continue
                if not grammar.matcher.consume_token(token):
                    # Only a token the mask did not cover gets here (e.g. one the request forced past the grammar):
                    # the rest of this request runs unconstrained rather than failing every later step.
                    logger.warning("request %s: token %d rejected by its grammar (%s); constraint dropped",
                                   request_id, token, grammar.matcher.get_error())
                    del self._rows[request_id]
                    break

