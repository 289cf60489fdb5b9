"""The default model under ``json_schema`` for many different schemas gives a valid document every time (batched,
greedy and sampled rows mixed). The default suite runs 10 schemas; the slow suite all 100."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from nxdserve.engine.structured import StructuredOutputsParams
from nxdserve.sampling_params import SamplingParams
from tests.helpers.engine import run_to_completion, shared_core, tokenize

NAMES = ["name", "age", "city", "score", "tags", "ok", "level", "id", "price", "colour", "email", "count"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "const"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 100}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "low", "high", "yes", "no"], rng.randint(2, 4))}
    if kind == "array":
        return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": rng.randint(0, 2), "maxItems": 3}
    if kind == "const":
        return {"const": rng.choice(["v1", 7, True])}
    return {"type": "boolean"}


def make_schema(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    keys = rng.sample(NAMES, rng.randint(1, 4))
    props: dict[str, Any] = {k: _leaf(rng) for k in keys}
    if rng.random() < 0.3:
        props["inner"] = {"type": "object", "properties": {"x": _leaf(rng)}, "required": ["x"],
                          "additionalProperties": False}
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


def _check(count: int) -> None:
    core = shared_core()
    schemas = [make_schema(i) for i in range(count)]
    prompts = tokenize(core, [f"Describe item {i} as JSON." for i in range(count)])
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=160,
                             structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
              for i, s in enumerate(schemas)]
    outs = run_to_completion(core, prompts, params)
    for schema, out in zip(schemas, outs, strict=True):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_ten_schemas_give_valid_documents() -> None:
    _check(10)


@pytest.mark.slow
def test_hundred_schemas_give_valid_documents() -> None:
    _check(100)
