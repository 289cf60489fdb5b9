"""Per-request token constraints: the bitmask of a step's constrained rows, and advancing on accepted tokens.

A row is constrained by a grammar (structured outputs), by ``allowed_token_ids`` or by ``bad_words`` (vLLM's
sampling parameters of those names), in any combination: the masks are ANDed.

``fill`` runs in the engine's worker thread before the forward (``EngineCore.execute``) and hands the bitmask's
computation to the manager's own thread, so that it overlaps the forward (the sampler waits for it); ``add``,
``advance`` and ``remove`` run between steps. A row with drafts gets one mask per verification position:
llguidance advances the matcher through the drafts and rolls it back, so a draft the grammar forbids cannot win
verification and the matcher's state is untouched until ``advance`` consumes the tokens actually accepted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.torch as lltorch
import numpy as np
import torch

from nxdserve.engine.structured.compiler import GrammarCompiler
from nxdserve.engine.structured.mask import StepTokenMask

if TYPE_CHECKING:
    from nxdserve.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass
class _RowState:
    matcher: llguidance.LLMatcher | None = None
    start_after: tuple[int, ...] = ()
    started: bool = True  # the grammar applies (a reasoning model's thinking has ended)
    recent: list[int] = field(default_factory=list)  # output tail, while waiting for ``start_after``
    allowed: torch.Tensor | None = None  # (W,) int32 bitmask of allowed_token_ids
    bad_words: list[list[int]] = field(default_factory=list)  # token sequences whose last token is banned after
    # the others


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, num_threads: int = 2) -> None:
        self.compiler = compiler
        self._rows: dict[str, _RowState] = {}
        self._executor: llguidance.LLExecutor | None = None
        # One thread: a step's fill ends before the next one's starts (the sampler waits for it), so a matcher is
        # never filled twice at once.
        self._filler: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None  # the last step's fill
        self._num_threads = num_threads
        self.mask_seconds = 0.0  # summed fill time, for the benchmark
        self.mask_steps = 0

    @property
    def active(self) -> bool:
        return bool(self._rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def add(self, request: Request) -> None:
        params = request.params
        spec = params.structured_outputs
        if spec is None and not params.allowed_token_ids and not params.bad_words:
            return
        state = _RowState()
        if spec is not None:
            state.matcher = self.compiler.new_matcher(spec)
            state.start_after = tuple(spec.start_after_token_ids)
            state.started = not state.start_after
        if params.allowed_token_ids:
            allowed = torch.zeros(_words(self.compiler.vocab_size), dtype=torch.int32)
            ids = torch.tensor(sorted(set(params.allowed_token_ids)), dtype=torch.int64)
            bits = torch.zeros(allowed.shape[0] * 32, dtype=torch.int64)
            bits[ids] = 1
            weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)
            packed = (bits.view(-1, 32) * weights).sum(dim=1)
            allowed.copy_(torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32))
            state.allowed = allowed
        if params.bad_words:
            state.bad_words = self.compiler.bad_words_token_ids(params.bad_words)
        self._rows[request.request_id] = state

    def remove(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._rows.pop(request_id, None)

    def fill(self, plan: Any, requests: Sequence[Request]) -> StepTokenMask | None:
        """The step's mask over constrained rows that sample (their drafts' positions included), or None. Drops
        draft alternatives of constrained rows: their extra token would be sampled without a mask."""
        entries: list[tuple[int, int, list[int], _RowState]] = []  # (plan row, first mask row, drafts, state)
        num_positions = 0
        for row, request in enumerate(requests):
            state = self._rows.get(request.request_id)
            if state is None or not plan.sample[row]:
                continue
            if state.matcher is not None and not state.started and state.allowed is None and not state.bad_words:
                continue  # thinking: unconstrained until it ends
            drafts = [int(t) for t in request.spec_token_ids[: int(plan.num_drafts[row])]]
            entries.append((row, num_positions, drafts, state))
            num_positions += 1 + len(drafts)
        if not entries:
            return None
        bitmask = lltorch.allocate_token_bitmask(num_positions, self.compiler.vocab_size)
        rows = np.concatenate([np.full(1 + len(d), r, dtype=np.int64) for r, _, d, _ in entries])
        positions = np.concatenate([np.arange(1 + len(d), dtype=np.int64) for _, _, d, _ in entries])
        if plan.draft_alternatives is not None:
            plan.draft_alternatives[[r for r, _, _, _ in entries]] = -1
        outputs = [list(requests[row].output_token_ids) if state.bad_words else [] for row, _, _, state in entries]
        if self._filler is None:
            self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nxdserve-mask")
        ready = self._filler.submit(self._fill, bitmask, entries, outputs)
        self._pending = ready
        return StepTokenMask(rows=rows, positions=positions, filled=bitmask, ready=ready)

    def _fill(self, bitmask: torch.Tensor, entries: list[tuple[int, int, list[int], _RowState]],
              outputs: list[list[int]]) -> None:
        t0 = time.perf_counter()
        grammar = [(s.matcher, first, drafts) for _, first, drafts, s in entries if s.matcher is not None and s.started]
        if grammar:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=self._num_threads)
            plain = [(m, first) for m, first, drafts in grammar if not drafts]
            drafting = [(m, first, drafts) for m, first, drafts in grammar if drafts]
            if plain:
                lltorch.fill_next_token_bitmask_par(self._executor, plain, bitmask)
            if drafting:
                lltorch.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafting, bitmask)
        for (_, first, drafts, state), output in zip(entries, outputs, strict=True):
            if state.allowed is not None:
                bitmask[first: first + 1 + len(drafts)] &= state.allowed
            if state.bad_words:
                _ban_bad_words(bitmask, first, output, drafts, state.bad_words)
        self.mask_seconds += time.perf_counter() - t0
        self.mask_steps += 1

    def shutdown(self) -> None:
        if self._filler is not None:
            self._filler.shutdown(wait=True)
            self._filler = None

    def advance(self, updates: Sequence[Any]) -> None:
        """Consume each constrained request's accepted tokens (``RequestUpdate``s of a step)."""
        if self._pending is not None:  # a backend that never read the mask: its fill must not race the matchers
            wait([self._pending])
            self._pending = None
        for update in updates:
            request_id = update.request.request_id
            state = self._rows.get(request_id)
            if state is None:
                continue
            if update.finished:
                del self._rows[request_id]
                continue
            if state.matcher is None:
                continue
            for token in update.new_token_ids:
                if not state.started:
                    state.recent = [*state.recent, token][-len(state.start_after):]
                    state.started = tuple(state.recent) == state.start_after
                    continue
                if not state.matcher.consume_token(token):
                    # Only a token the mask did not cover gets here (e.g. one the request forced past the grammar):
                    # the rest of this request runs unconstrained rather than failing every later step.
                    logger.warning("request %s: token %d rejected by its grammar (%s); constraint dropped",
                                   request_id, token, state.matcher.get_error())
                    state.matcher = None
                    break


def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _ban_bad_words(bitmask: torch.Tensor, first: int, output: list[int], drafts: list[int],
                   bad_words: list[list[int]]) -> None:
    """vLLM's rule: a bad word's last token is banned where the output ends with the word's other tokens."""
    for j in range(1 + len(drafts)):
        context = output + drafts[:j]
        for word in bad_words:
            prefix = word[:-1]
            if not prefix or (len(context) >= len(prefix) and context[len(context) - len(prefix):] == prefix):
                token = word[-1]
                bitmask[first + j, token // 32] &= ~(1 << (token % 32)) if token % 32 != 31 else 0x7FFFFFFF
