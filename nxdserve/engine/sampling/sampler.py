"""The sampler every backend uses: vectorised, per-row parameters, per-row seeded generators.

Pipeline per logits row, in vLLM V1's order:
  logit bias + min-tokens masking -> penalties -> (greedy rows: argmax) -> temperature
  -> min-p / top-k / top-p -> exponential race  argmax(p / q), q ~ Exp(1).
Every stage runs only for the rows that need it, decided from host-side numpy (no device syncs):
an all-greedy batch without processors is one argmax. Returned logprobs are of the raw model
distribution. ``verify`` adds rejection sampling for speculative decoding on top of the same stages.

Randomness: a seeded row draws its noise from its own generator, one (V,) draw per sampled token
(verify: first its num_drafts uniforms, then one (V,) draw), so a seed gives the same tokens
whatever else is in the batch and in whatever order. Unseeded rows share the sampler's generator
in one batched draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nxdserve.engine.models.cpu_kernels import argmax
from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.sampling.logprobs import compute_logprobs
from nxdserve.engine.sampling.noise import exponential_, race, uniform_
from nxdserve.engine.sampling.processors import ProcessorPlan, apply_processors
from nxdserve.engine.sampling.rejection import (
    DraftLayout,
    accept_random,
    accepted_prefix,
    assemble,
    residual,
)
from nxdserve.engine.sampling.rows import RowParams, SlotTables, to_device
from nxdserve.engine.sampling.truncation import NEG_INF, Support, restrict_support
from nxdserve.engine.step import LogprobsBlock
from nxdserve.engine.structured.mask import TokenMask

# top-k/top-p candidate sets tried before a full sort (see truncation.py). On one CPU core a 50k-wide
# sort costs ~3.4 ms per row, a top-64 ~0.09 ms and a top-1024 ~0.6 ms; on accelerators sorting is cheap.
CPU_CANDIDATE_LADDER = (64, 1024)
DEVICE_CANDIDATE_LADDER = (128,)


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # (N,) int64
    # shapes (N, 1 + n): entry [:, 0] is the sampled token; n = max requested top-logprobs among rows
    logprobs: LogprobsBlock | None


@dataclass
class VerifyOutput:
    token_ids: torch.Tensor  # (N, W) int64, -1 padded
    num_tokens: torch.Tensor  # (N,) int64 in 1..num_drafts[i] + 1
    logprobs: LogprobsBlock | None  # shapes (N, W, 1 + n); padding entries have id -1, rank 0


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        seed: int = 0,
        candidate_ladder: tuple[int, ...] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        if candidate_ladder is None:
            cpu = self.device.type == "cpu"
            candidate_ladder = CPU_CANDIDATE_LADDER if cpu else DEVICE_CANDIDATE_LADDER
        self.candidate_ladder = candidate_ladder
        self._tables: SlotTables | None = None

    # -- public API --------------------------------------------------------------------------------
    def sample(
        self, logits: torch.Tensor, slots: np.ndarray, batch: PersistentBatch, token_mask: TokenMask | None = None
    ) -> SampleOutput:
        """One token per row of ``logits`` (N, V); row i uses the parameters of ``slots[i]``. ``token_mask``
        (structured outputs) limits some rows to their allowed tokens; logprobs stay the model's."""
        logits = model_logits = self._trim(logits)
        if token_mask is None and batch.plain_greedy[slots].all():
            # What the general path below computes for such rows, without its per-row gathers (~0.2 ms of a
            # ~10 ms single-stream CPU step, measured: benchmarks/perf_notes.md).
            return SampleOutput(token_ids=argmax(logits.float()), logprobs=None)
        if token_mask is not None:
            logits = token_mask.masked(logits)
        rows = RowParams.gather(batch, slots)
        tables = self._slot_tables(batch)
        plan = ProcessorPlan.build(rows, tables)
        num_top = int(rows.num_logprobs.max(initial=-1))
        raw = logits.float()  # the same tensor when already fp32
        if plan.empty and rows.greedy.all():
            tokens = argmax(raw)
        else:
            work = raw
            if not plan.empty:
                # Processors write in place: never into the caller's logits, nor into the raw
                # logits still needed for logprobs.
                work = raw.clone() if raw is logits or num_top >= 0 else raw
                apply_processors(work, plan, rows, tables, batch)
            writable = work is not logits and not (work is raw and num_top >= 0)
            tokens = self._select(work, rows, batch, tables, writable)
        if num_top >= 0 and token_mask is not None:
            raw = model_logits.float()
        logprobs = compute_logprobs(raw, tokens, num_top) if num_top >= 0 else None
        return SampleOutput(token_ids=tokens, logprobs=logprobs)

    def plain_greedy(self, slots: np.ndarray, batch: PersistentBatch) -> bool:
        """Whether these rows' tokens are a plain argmax (greedy, no processors, no logprobs), as ``sample``
        and ``verify`` then take them: the argmax may come straight from the LM head
        (``SlotModelRunner.greedy_tokens``)."""
        if batch.plain_greedy[slots].all():
            return True
        rows = RowParams.gather(batch, slots)
        if not rows.greedy.all() or int(rows.num_logprobs.max(initial=-1)) >= 0:
            return False
        return ProcessorPlan.build(rows, self._slot_tables(batch)).empty

    def verify(
        self,
        logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        num_drafts: torch.Tensor,
        slots: np.ndarray,
        batch: PersistentBatch,
        draft_probs: torch.Tensor | None,
        token_mask: TokenMask | None = None,
    ) -> VerifyOutput:
        """Rejection-sample drafts against target ``logits`` (N, W, V).

        Row i judges ``draft_token_ids[i, :num_drafts[i]]``; ``logits[i, j]`` (j <= num_drafts[i])
        predicts the token after draft j - 1. ``draft_probs`` (N, >= W - 1, V), on the logits' device,
        are the proposer's probabilities, or None for point proposals. ``token_mask`` (structured outputs) indexes
        the (N * W) positions: a draft its grammar forbids is never accepted.
        """
        logits = model_logits = self._trim(logits)
        n, width, vocab = logits.shape
        if token_mask is not None:
            logits = token_mask.masked(logits.reshape(n * width, vocab)).view(n, width, vocab)
        device = logits.device
        max_drafts = width - 1
        drafts = draft_token_ids[:, :max_drafts].to(device=device, dtype=torch.long)
        nd = num_drafts.detach().cpu().numpy().astype(np.int64)
        assert nd.shape == (n,) and (nd >= 0).all() and (nd <= max_drafts).all(), "bad num_drafts"
        slots = np.asarray(slots, dtype=np.int64)
        if self.plain_greedy(slots, batch):
            # No processor applies at the first position, so none at later ones either (drafts only
            # bring min_tokens closer): the plain argmax at every position decides.
            return _verify_greedy(logits, drafts, torch.from_numpy(nd).to(device))
        layout = DraftLayout.build(nd)

        # Only real positions are processed: a private fp32 copy of those rows.
        flat_idx = to_device(layout.src * width + layout.pos, device)
        work = logits.reshape(n * width, vocab).index_select(0, flat_idx).float()
        rows = RowParams.gather(batch, slots[layout.src], extra=layout.pos, src=layout.src)
        tables = self._slot_tables(batch)
        plan = ProcessorPlan.build(rows, tables)
        if not plan.empty:
            penalised_after_drafts = plan.penalty_rows.size and rows.extra[plan.penalty_rows].any()
            host_drafts = drafts.cpu().numpy() if penalised_after_drafts else None
            apply_processors(work, plan, rows, tables, batch, host_drafts)

        # Greedy rows: the processed argmax at every position; random rows: the target distribution.
        greedy_flat = rows.greedy
        greedy = greedy_flat[layout.first]
        target = torch.full((layout.num_positions,), -1, dtype=torch.long, device=device)
        gi = np.flatnonzero(greedy_flat)
        if gi.size:
            g = to_device(gi, device)
            target[g] = argmax(work.index_select(0, g))
        ri = np.flatnonzero(~greedy_flat)
        probs = self._target_probs(work, ri, rows) if ri.size else None
        prob_row = np.full(layout.num_positions, -1, dtype=np.int64)  # flat row -> row of ``probs``
        prob_row[ri] = np.arange(ri.size)

        rb, u, q = self._verify_noise(nd, np.flatnonzero(~greedy), slots, batch, tables, vocab, device)

        # Judge every draft at once; the accepted prefix is a cumprod over the accept flags.
        accept = torch.zeros(n, max_drafts, dtype=torch.bool, device=device)
        judged = layout.judged(nd)
        for sel, is_greedy in ((judged[greedy_flat[judged]], True), (judged[~greedy_flat[judged]], False)):
            if not sel.size:
                continue
            i_t, j_t = to_device(layout.src[sel], device), to_device(layout.pos[sel], device)
            x = drafts[i_t, j_t]
            if is_greedy:
                accept[i_t, j_t] = target[to_device(sel, device)] == x
            else:
                assert probs is not None
                p_target = probs[to_device(prob_row[sel], device), x]
                p_draft = None if draft_probs is None else draft_probs[i_t, j_t, x].to(p_target)
                accept[i_t, j_t] = accept_random(p_target, p_draft, u[i_t, j_t])
        num_accepted = accepted_prefix(accept)
        final_flat = to_device(layout.first, device) + num_accepted

        # The one extra token: the target's argmax (greedy), else recovered or bonus (random).
        final = torch.empty(n, dtype=torch.long, device=device)
        if rb.size:
            assert probs is not None
            rb_t = to_device(rb, device)
            acc = num_accepted[rb_t]
            p_final = probs[to_device(prob_row, device)[final_flat[rb_t]]]
            if max_drafts:
                rejected = acc < to_device(nd[rb], device)
                at = acc.clamp(max=max_drafts - 1)  # bonus rows read any draft: masked by ``rejected``
                d_probs = None if draft_probs is None else draft_probs[rb_t, at].to(p_final)
                p_final = residual(p_final, rejected, d_probs, drafts[rb_t, at])
            final[rb_t] = race(p_final, q)
        if greedy.any():
            gb = to_device(np.flatnonzero(greedy), device)
            final[gb] = target[final_flat[gb]]

        token_ids = assemble(drafts, num_accepted, final, width)
        num_top = int(rows.num_logprobs.max(initial=-1))
        logprobs = compute_logprobs(model_logits, token_ids, num_top) if num_top >= 0 else None
        return VerifyOutput(token_ids=token_ids, num_tokens=num_accepted + 1, logprobs=logprobs)

    def _verify_noise(
        self,
        nd: np.ndarray,
        random_rows: np.ndarray,
        slots: np.ndarray,
        batch: PersistentBatch,
        tables: SlotTables,
        vocab: int,
        device: torch.device,
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """Uniforms for every draft (N, D) and one Exp(1) row per random row, in the returned row order.

        Unseeded rows come first and share one batched draw; a seeded row draws its nd uniforms, then
        its (V,) exponentials, from its own generator (rows without drafts draw no uniforms).
        """
        max_drafts = int(nd.max(initial=0))
        seeded = tables.seeded[slots[random_rows]]
        order = np.concatenate([random_rows[~seeded], random_rows[seeded]])
        num_free = int((~seeded).sum())
        u = torch.zeros(nd.shape[0], max(max_drafts, 1), device=device)
        q = torch.empty(order.size, vocab, device=device)
        if num_free:
            free_u = uniform_(torch.empty(num_free, u.shape[1], device=device), self.generator)
            u[to_device(order[:num_free], device)] = free_u
            exponential_(q[:num_free], self.generator)
        for k in range(num_free, order.size):
            i = int(order[k])
            gen = batch.generators[int(slots[i])]
            if nd[i]:
                uniform_(u[i, : nd[i]], gen)
            exponential_(q[k], gen)
        return order, u, q

    # -- stages ------------------------------------------------------------------------------------
    def _select(
        self, work: torch.Tensor, rows: RowParams, batch: PersistentBatch, tables: SlotTables, writable: bool
    ) -> torch.Tensor:
        """Greedy rows: argmax of the processed logits; random rows: the exponential race."""
        greedy = rows.greedy
        if greedy.all():
            return argmax(work)
        ri = np.flatnonzero(~greedy)
        if ri.size == rows.num_rows:
            return self._sample_random(work, ri, rows, batch, tables, writable)
        tokens = torch.empty(rows.num_rows, dtype=torch.long, device=work.device)
        g = to_device(np.flatnonzero(greedy), work.device)
        tokens[g] = argmax(work.index_select(0, g))
        tokens[to_device(ri, work.device)] = self._sample_random(work, ri, rows, batch, tables, writable)
        return tokens

    def _scaled(self, work: torch.Tensor, ri: np.ndarray, rows: RowParams, writable: bool) -> tuple[torch.Tensor, bool]:
        """Rows ``ri`` of ``work`` divided by their temperature, and whether the result is ours to
        overwrite (``work`` itself is written only when ``writable``)."""
        whole = ri.size == rows.num_rows
        sub = work if whole else work.index_select(0, to_device(ri, work.device))
        private = writable or not whole
        temperature = rows.temperature[ri]
        if (temperature != 1.0).any():
            t = to_device(temperature, work.device)[:, None]
            sub = sub.div_(t) if private else sub / t
            private = True
        return sub, private

    def _support(self, scaled: torch.Tensor, ri: np.ndarray, rows: RowParams) -> Support:
        return restrict_support(scaled, rows.top_k[ri], rows.top_p[ri], rows.min_p[ri], self.candidate_ladder)

    def _target_probs(self, work: torch.Tensor, ri: np.ndarray, rows: RowParams) -> torch.Tensor:
        """Normalised target distribution of random rows ``ri`` (verify needs p(x) exactly)."""
        scaled, _ = self._scaled(work, ri, rows, writable=True)
        support = self._support(scaled, ri, rows)
        if support.threshold is not None:
            scaled = scaled.masked_fill_(scaled < support.threshold[:, None], NEG_INF)
        return torch.softmax(scaled, dim=-1)

    def _sample_random(
        self,
        work: torch.Tensor,
        ri: np.ndarray,
        rows: RowParams,
        batch: PersistentBatch,
        tables: SlotTables,
        writable: bool,
    ) -> torch.Tensor:
        """Exponential race for rows ``ri``: over their candidates when the whole support lies
        there, else over the full vocabulary."""
        scaled, private = self._scaled(work, ri, rows, writable)
        support = self._support(scaled, ri, rows)
        slots = rows.slots[ri]
        seeded = tables.seeded[slots]
        # The one per-row Python loop: seeded rows' generators (their draws cannot be batched).
        gens = {int(r): batch.generators[int(slots[r])] for r in np.flatnonzero(seeded)}
        out = torch.empty(scaled.shape[0], dtype=torch.long, device=work.device)
        in_cand = np.zeros(scaled.shape[0], dtype=bool)
        if support.cand_rows is not None:
            in_cand[support.cand_rows] = True
            cand = self._race_candidates(support, seeded, gens, scaled.shape[1])
            out[to_device(support.cand_rows, work.device)] = cand
        full = np.flatnonzero(~in_cand)
        if full.size:
            truncated = (rows.min_p[ri] > 0) | (rows.top_p[ri] < 1) | (rows.top_k[ri] > 0)
            threshold = support.threshold if truncated[full].any() else None
            order, tokens = self._race_full(scaled, private, full, threshold, seeded, gens)
            out[to_device(order, work.device)] = tokens
        return out

    def _race_full(
        self,
        scaled: torch.Tensor,
        private: bool,
        full: np.ndarray,
        threshold: torch.Tensor | None,
        seeded: np.ndarray,
        gens: dict[int, torch.Generator | None],
    ) -> tuple[np.ndarray, torch.Tensor]:
        """Race over all V tokens for rows ``full``; returns (row order, tokens in that order)."""
        device = scaled.device
        # Unseeded rows first so that their noise is one batched draw.
        is_seeded = seeded[full]
        order = np.concatenate([full[~is_seeded], full[is_seeded]])
        num_free = int((~is_seeded).sum())
        q = torch.empty(order.size, scaled.shape[1], device=device)
        if num_free:
            exponential_(q[:num_free], self.generator)
        for k in range(num_free, order.size):
            exponential_(q[k], gens[int(order[k])])
        o = to_device(order, device)
        identity = order.size == scaled.shape[0] and bool((order == np.arange(order.size)).all())
        logits = scaled if identity else scaled.index_select(0, o)
        if threshold is not None:
            logits = logits.masked_fill(logits < threshold[o, None], NEG_INF)
        elif identity and not private:
            logits = logits.clone()
        # Unnormalised probabilities, in place: the race does not need them to sum to one.
        weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        return order, race(weights, q)

    def _race_candidates(
        self, support: Support, seeded: np.ndarray, gens: dict[int, torch.Generator | None], vocab: int
    ) -> torch.Tensor:
        """Race over each candidate row's K candidates (its whole support)."""
        assert support.cand_rows is not None and support.cand_ids is not None and support.cand_logits is not None
        cand_ids, cand_logits = support.cand_ids, support.cand_logits
        q = exponential_(torch.empty(cand_ids.shape, device=cand_ids.device), self.generator)
        for k in np.flatnonzero(seeded[support.cand_rows]):
            # The same (V,) draw a full-vocabulary race would use, read at the candidates: the token
            # does not depend on which path the row took.
            gen = gens[int(support.cand_rows[k])]
            q[k] = exponential_(torch.empty(vocab, device=cand_ids.device), gen)[cand_ids[k]]
        weights = torch.exp(cand_logits - cand_logits[:, :1])
        return cand_ids.gather(1, race(weights, q)[:, None]).squeeze(1)

    # -- helpers -----------------------------------------------------------------------------------
    def _trim(self, logits: torch.Tensor) -> torch.Tensor:
        """Drop the lm_head's padding columns past the real vocabulary."""
        vocab = logits.shape[-1]
        if vocab < self.vocab_size:
            raise ValueError(f"logits have {vocab} columns, vocabulary is {self.vocab_size}")
        return logits if vocab == self.vocab_size else logits[..., : self.vocab_size]

    def _slot_tables(self, batch: PersistentBatch) -> SlotTables:
        if self._tables is None or not self._tables.matches(batch):
            self._tables = SlotTables(batch)
        return self._tables


def _verify_greedy(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> VerifyOutput:
    """All-greedy rows without processors or logprobs: accept while a draft equals the target's argmax,
    then the argmax after the accepted prefix (the bonus token when all were accepted). One argmax
    over (N, W, V) instead of the general path's per-position gathers (measured ~1 ms a step at batch 1)."""
    return accept_greedy(argmax(logits), drafts, num_drafts)


def accept_greedy(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> VerifyOutput:
    """``_verify_greedy`` given the target's argmax at every position, ``target`` (N, W)."""
    width = target.shape[1]
    if width > 1:
        col = torch.arange(width - 1, device=target.device)[None, :]
        match = (target[:, : width - 1] == drafts) & (col < num_drafts[:, None])
        num_accepted = match.long().cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(target.shape[0], dtype=torch.long, device=target.device)
    final = target.gather(1, num_accepted[:, None]).squeeze(1)
    return VerifyOutput(token_ids=assemble(drafts, num_accepted, final, width), num_tokens=num_accepted + 1,
                        logprobs=None)
