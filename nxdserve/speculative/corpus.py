"""Self-distillation data for EAGLE: the target answers a prompt set, and we keep its hidden states.

The target generates through the real engine (continuous batching, the serve-time dtype), with a
recorder in the proposer hook that copies the final hidden state of every token the backend runs.
So the features the head learns from are exactly the ones it will read when serving.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.request import Request
from nxdserve.engine.step import StepResult
from nxdserve.sampling_params import OutputKind, SamplingParams
from nxdserve.scheduler.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class Sequence:
    tokens: np.ndarray  # (L,) int64 prompt + response
    features: torch.Tensor  # (L - 1, H) serving dtype: the target's final hidden state at positions 0..L-2
    prompt_len: int
    prompt_index: int = -1  # position of its prompt in the list given to generate_corpus
    sampled: bool = False  # a sampled answer (temperature > 0), not the greedy one


def load_prompts(path: str | Path | None = None) -> list[str]:
    """Prompts from a JSONL file of {"prompt": ...} (default: the set shipped with nxdserve)."""
    if path is None:
        text = resources.files("nxdserve.speculative").joinpath("data/prompts.jsonl").read_text()
    else:
        text = Path(path).read_text()
    prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {path or 'the default prompt set'}")
    return prompts


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """As the chat endpoint does: render the template to text, then tokenize it."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer.encode(str(text), add_special_tokens=False))


class FeatureRecorder:
    """A Proposer that drafts nothing and records the backend's per-token hidden states."""

    max_spec_tokens = 0

    def __init__(self) -> None:
        self.chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def propose(
        self, requests: list[Request], batch: PersistentBatch, sched: SchedulerOutput, result: StepResult
    ) -> None:
        hidden, offsets = result.token_hidden_states, result.token_offsets
        assert hidden is not None and offsets is not None, "the backend keeps hidden states for the recorder"
        for row, request in enumerate(sched.requests):
            span = hidden[int(offsets[row]) : int(offsets[row + 1])]
            start = int(sched.plan.start_pos[row])
            # Kept in the serving dtype (bf16 states are exact in bf16): half the memory of float32
            # for a corpus of a few hundred thousand tokens.
            self.chunks.setdefault(request.request_id, []).append((start, span.cpu().clone()))

    def features(self, request_id: str, length: int) -> torch.Tensor:
        parts = sorted(self.chunks.pop(request_id), key=lambda c: c[0])
        out = torch.cat([p for _, p in parts])
        return out[:length]


def generate_corpus(
    core: Any, prompts: list[str], max_new_tokens: int, progress: Any | None = None, temperature: float = 0.0,
    seed: int = 0,
) -> list[Sequence]:
    """Run every prompt (chat template applied) through ``core``; return tokens with their features."""
    recorder = FeatureRecorder()
    core.proposer = recorder
    core.backend.keep_hidden_states = True
    tokenizer = core.tokenizer
    pending: dict[str, tuple[int, list[int]]] = {}
    for i, prompt in enumerate(prompts):
        ids = chat_prompt_ids(tokenizer, prompt)[: core.max_prompt_len]
        max_tokens = min(max_new_tokens, core.max_model_len - len(ids))
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i if temperature else None)
        params.output_kind = OutputKind.FINAL_ONLY
        request = core.make_request(ids, params)
        core.add_request(request)
        pending[request.request_id] = (i, ids)
    corpus: list[Sequence] = []
    while core.has_unfinished:
        for out in core.step():
            if not out.finished:
                continue
            index, prompt_ids = pending.pop(out.request_id)
            tokens = np.asarray(prompt_ids + list(out.outputs[0].token_ids), dtype=np.int64)
            features = recorder.features(out.request_id, tokens.size - 1)
            corpus.append(Sequence(tokens, features, len(prompt_ids), index, temperature > 0))
            if progress is not None:
                progress.update(1)
    core.proposer = None
    core.backend.keep_hidden_states = False
    return corpus


# (prompts as token ids, max new tokens, temperature, seed) -> each prompt's continuation, eos included.
Generate = Callable[[list[list[int]], int, float, int], list[list[int]]]


def engine_generate(core: Any) -> Generate:
    """``Generate`` through an EngineCore (the CPU path of train-eagle)."""

    def generate(prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> list[list[int]]:
        pending: dict[str, int] = {}
        for i, ids in enumerate(prompts):
            params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens,
                                    seed=seed + i if temperature else None)
            params.output_kind = OutputKind.FINAL_ONLY
            request = core.make_request(ids, params)
            core.add_request(request)
            pending[request.request_id] = i
        out: list[list[int]] = [[] for _ in prompts]
        while core.has_unfinished:
            for result in core.step():
                if result.finished:
                    out[pending.pop(result.request_id)] = list(result.outputs[0].token_ids)
        return out

    return generate


def self_written_prompts(
    tokenizer: Any, generate: Generate, count: int, eos_ids: frozenset[int], seed: int
) -> list[str]:
    """``count`` user questions written by the target itself: the chat template up to a user turn, sampled at
    temperature 1. More varied than any fixed prompt set, and in the target's own domain."""
    marker = "\u2063QUESTION\u2063"
    rendered = str(tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                                 add_generation_prompt=False))
    prefix = list(tokenizer.encode(rendered[: rendered.index(marker)], add_special_tokens=False))
    texts: list[str] = []
    seen: set[str] = set()
    for attempt in range(4):
        if len(texts) >= count:
            break
        for tokens in generate([prefix] * (count - len(texts)), 64, 1.0, seed + 7919 * attempt):
            if not tokens or tokens[-1] not in eos_ids:
                continue  # ran past 64 tokens without ending its turn: rambling, not a question
            text = tokenizer.decode(tokens[:-1], skip_special_tokens=True).strip()
            if 12 <= len(text) <= 300 and text not in seen:
                seen.add(text)
                texts.append(text)
    logger.info("the target wrote %d prompts", len(texts))
    return texts[:count]
