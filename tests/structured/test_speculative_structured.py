"""Constrained decoding under n-gram and EAGLE speculation equals constrained decoding without it (fp32 greedy):
drafts are verified under each position's mask, so a draft the grammar forbids is never accepted."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import numpy as np
import pytest

from nxdserve.engine.core import EngineCore
from nxdserve.engine.structured import StructuredOutputsParams
from nxdserve.sampling_params import SamplingParams
from tests.helpers.eagle import eagle_head
from tests.helpers.engine import PROMPTS, make_core, run_to_completion, shared_core, tokenize

SCHEMA = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["id", "colour"], "additionalProperties": False}}
SPECS: list[dict[str, Any]] = [
    {"json": SCHEMA, "disable_any_whitespace": True},
    {"regex": r"(la ){3,6}(da|di)"},
    {"choice": ["one two one two", "one two three"]},
]


@cache
def core_for(method: str | None) -> EngineCore:
    spec = None
    if method == "ngram":
        spec = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4, "num_speculative_tokens": 3}
    elif method == "eagle":
        spec = {"method": "eagle", "model": eagle_head(None, "identity"), "num_speculative_tokens": 3}
    if spec is None:
        return shared_core()  # the other structured tests' core
    spec["disable_by_batch_size"] = 1024
    return make_core(speculative_config=spec)


def _run(core: EngineCore) -> tuple[list[list[int]], int, int]:
    """The outputs' tokens, and the drafts verified and accepted for constrained rows on the way."""
    counts = [0, 0]
    execute = core.backend.execute

    def counting_execute(plan: Any) -> Any:
        result = execute(plan)
        if plan.token_mask is not None:
            rows = np.unique(plan.token_mask.rows)
            counts[0] += int(plan.num_drafts[rows].sum())
            counts[1] += int((result.num_sampled[rows] - 1).clip(min=0).sum())
        return result

    core.backend.execute = counting_execute  # type: ignore[method-assign]
    prompts = tokenize(core, [f"{p} Answer in JSON." for p in PROMPTS[:3]])
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(**s))
              for s in SPECS]
    try:
        outs = run_to_completion(core, prompts, params)
    finally:
        core.backend.execute = execute  # type: ignore[method-assign]
    return [o.outputs[0].token_ids for o in outs], counts[0], counts[1]


@pytest.mark.parametrize("method", ["ngram", pytest.param("eagle", marks=pytest.mark.slow)])
def test_constrained_output_is_identical_with_speculation(method: str) -> None:
    plain, _, _ = _run(core_for(None))
    core = core_for(method)
    speculative, verified, accepted = _run(core)
    assert speculative == plain
    assert len(json.loads(core.tokenizer.decode(plain[0], skip_special_tokens=True))) == 3
    assert verified > accepted  # constrained rows' drafts were verified under the mask, and some rejected
    if method == "ngram":
        assert accepted > 0
