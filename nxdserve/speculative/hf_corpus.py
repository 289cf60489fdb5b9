"""Self-distillation data through transformers' ``generate``, for ``train-eagle --device cuda``.

On an accelerator the corpus is generated with the target as transformers runs it (same weights, the
serving dtype): batched ``generate`` for the answers, then one forward per batch of whole sequences for
the final-norm hidden states the head learns from. The CPU path (``corpus.py``) runs the engine itself
instead, so its features are bit-for-bit what serving reads; here they differ from the CPU engine's by
kernel rounding only, which the head's training noise (``--feature-noise``) already covers.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from nxdserve.speculative.corpus import Sequence, chat_prompt_ids

logger = logging.getLogger(__name__)


@torch.inference_mode()
def generate_tokens(
    model: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float, eos_ids: list[int],
    pad_id: int, batch_size: int, seed: int, progress: Any | None = None,
) -> list[list[int]]:
    """Each prompt's continuation (up to and including the first eos), batched and left-padded."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    sampling = temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=sampling, temperature=temperature if sampling else None,
        top_k=0 if sampling else None, top_p=1.0 if sampling else None, eos_token_id=eos_ids, pad_token_id=pad_id,
    )  # fmt: skip
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    torch.manual_seed(seed)
    for lo in range(0, len(order), batch_size):
        index = order[lo : lo + batch_size]
        width = max(len(prompts[i]) for i in index)
        ids = torch.full((len(index), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(index), width), dtype=torch.long)
        for row, i in enumerate(index):
            n = len(prompts[i])
            ids[row, width - n :] = torch.tensor(prompts[i])
            mask[row, width - n :] = 1
        generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                   generation_config=config)[:, width:].cpu().numpy()
        for row, i in enumerate(index):
            tokens = generated[row].tolist()
            for j, token in enumerate(tokens):
                if token in eos_ids:
                    tokens = tokens[: j + 1]
                    break
            out[i] = tokens
        if progress is not None:
            progress.update(len(index))
    return out


@torch.inference_mode()
def final_hidden_states(model: Any, sequences: list[list[int]], pad_id: int, batch_size: int) -> list[torch.Tensor]:
    """Each sequence's final-norm hidden states at positions 0..L-2, on the CPU in the model's dtype."""
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor] = [torch.empty(0) for _ in sequences]
    for lo in range(0, len(order), batch_size):
        index = order[lo : lo + batch_size]
        width = max(len(sequences[i]) for i in index)
        ids = torch.full((len(index), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(index), width), dtype=torch.long)
        for row, i in enumerate(index):  # right padding: positions 0.. are the real ones
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
            mask[row, : len(sequences[i])] = 1
        hidden = model.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        for row, i in enumerate(index):
            out[i] = hidden[row, : len(sequences[i]) - 1].cpu().clone()
    return out


def generate_corpus_hf(
    model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int, max_len: int, eos_ids: list[int],
    batch_size: int, temperature: float = 0.0, seed: int = 0, progress: Any | None = None,
) -> list[Sequence]:
    """``corpus.generate_corpus`` through transformers: every prompt answered, with the target's features."""
    pad_id = eos_ids[0]
    prompt_ids = [chat_prompt_ids(tokenizer, p)[: max_len - 2] for p in prompts]
    budget = [max(1, min(max_new_tokens, max_len - len(ids))) for ids in prompt_ids]
    answers: list[list[int]] = [[] for _ in prompts]
    # generate() takes one max_new_tokens per call: group prompts by their own cap (nearly always one group).
    for cap in sorted(set(budget)):
        group = [i for i, b in enumerate(budget) if b == cap]
        got = generate_tokens(model, [prompt_ids[i] for i in group], cap, temperature, eos_ids, pad_id, batch_size,
                              seed, progress)
        for i, tokens in zip(group, got, strict=True):
            answers[i] = tokens
    sequences = [ids + answer for ids, answer in zip(prompt_ids, answers, strict=True)]
    features = final_hidden_states(model, sequences, pad_id, batch_size)
    return [
        Sequence(np.asarray(seq, dtype=np.int64), feats, len(ids), i, temperature > 0)
        for i, (seq, feats, ids) in enumerate(zip(sequences, features, prompt_ids, strict=True))
        if len(seq) > len(ids)
    ]
