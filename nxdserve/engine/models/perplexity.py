"""Perplexity and top-1 agreement of a model on a text, for comparing weight formats (tests, benchmarks)."""

from __future__ import annotations

import numpy as np
import torch

from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.engine.models.runner import SlotModelRunner


@torch.inference_mode()
def next_token_logits(model: LlamaFamilyModel, token_ids: list[int]) -> torch.Tensor:
    """(T, vocab) fp32 logits of every position, the whole text as one prefill row."""
    n = len(token_ids)
    runner = SlotModelRunner(model, num_slots=1, max_len=n)
    hidden = runner.run(torch.tensor(token_ids), np.array([0]), np.array([0]), np.array([n]))
    return runner.logits(hidden)


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of tokens 1.. given the logits of positions 0..T-2."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -logp.gather(1, torch.tensor(token_ids[1:])[:, None]).mean()
    return float(torch.exp(nll))


def top1_agreement(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Share of positions whose argmax equals the reference's (teacher-forced greedy agreement)."""
    return float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
