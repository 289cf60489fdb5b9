"""Helpers that build real engine cores and run requests to completion, synchronously."""

from __future__ import annotations

from functools import cache
from typing import Any

from nxdserve.config import EngineConfig
from nxdserve.engine.core import EngineCore
from nxdserve.engine.loader import build_engine_core
from nxdserve.engine.outputs import RequestOutput
from nxdserve.sampling_params import OutputKind, SamplingParams


def make_core(**overrides: Any) -> EngineCore:
    settings: dict[str, Any] = {"model": None, "backend": "torch", "dtype": "float32", "max_model_len": 256,
                                "max_num_seqs": 16}
    settings.update(overrides)
    core, _ = build_engine_core(EngineConfig(**settings))
    return core


@cache
def shared_core(**overrides: Any) -> EngineCore:
    """One core per configuration for the whole session (loading the model dominates test time)."""
    return make_core(**overrides)


def run_to_completion(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                      max_steps: int = 10_000) -> list[RequestOutput]:
    """Submit all prompts at once and step until every one finishes; returns final outputs in order."""
    if isinstance(params, SamplingParams):
        params = [SamplingParams(**vars(params)) for _ in prompts]  # each request owns its params
    ids = []
    for prompt, p in zip(prompts, params, strict=True):
        p.output_kind = OutputKind.FINAL_ONLY
        request = core.make_request(prompt, p)
        core.add_request(request)
        ids.append(request.request_id)
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
        if not core.has_unfinished:
            break
    assert not core.has_unfinished, "requests did not finish"
    return [finals[i] for i in ids]


def tokenize(core: EngineCore, texts: list[str]) -> list[list[int]]:
    return [list(core.tokenizer.encode(t)) for t in texts]


PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colours:",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Translate to French: good morning",
    "Q: What is 2 + 2?\nA:",
    "import numpy as np\n",
    "Dear Sir or Madam,",
    "The meaning of life is",
    "In 1492, Columbus",
    "A short poem about autumn leaves falling:",
    "Explain gravity to a child.",
    "Hello, my name is",
]
