"""Logprobs of the raw model distribution (vLLM's default ``raw_logprobs``)."""

from __future__ import annotations

import torch

from nxdserve.engine.step import LogprobsBlock


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsBlock:
    """log_softmax(logits) in fp32 at ``token_ids`` plus the top ``num_top`` alternatives.

    ``logits`` is (..., V) and ``token_ids`` (...). Entry [..., 0] is the given token, entries
    [..., 1:] the top-n ids/logprobs in descending order, and ``ranks`` the given token's rank
    (1 = best; as vLLM, the number of tokens at least as likely, itself included). A negative id
    marks padding: it keeps id -1, logprob -inf and rank 0.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = token_ids.to(device=logprobs.device, dtype=torch.long)
    pad = ids < 0
    chosen = logprobs.gather(-1, ids.clamp(min=0).unsqueeze(-1))  # (..., 1)
    ranks = (logprobs >= chosen).sum(dim=-1)
    chosen = chosen.masked_fill(pad.unsqueeze(-1), float("-inf"))
    ranks = ranks.masked_fill(pad, 0)
    num_top = min(max(num_top, 0), logprobs.shape[-1])
    if num_top:
        top_lp, top_ids = logprobs.topk(num_top, dim=-1)
        out_ids = torch.cat([ids.unsqueeze(-1), top_ids], dim=-1)
        out_lp = torch.cat([chosen, top_lp], dim=-1)
    else:
        out_ids, out_lp = ids.unsqueeze(-1), chosen
    return LogprobsBlock(
        token_ids=out_ids.cpu().numpy().astype("int64", copy=False),
        logprobs=out_lp.cpu().numpy().astype("float32", copy=False),
        ranks=ranks.cpu().numpy().astype("int64", copy=False),
    )
