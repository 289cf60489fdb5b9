"""Constrained decoding in the engine (default model, fp32): choices and regexes always match, JSON schemas give
valid documents, a finished grammar ends the request, bad specs are typed errors, and speculation does not change
constrained output."""

from __future__ import annotations

import json
import re

import pytest

from nxdserve.engine.structured import StructuredOutputsParams
from nxdserve.errors import InvalidRequestError
from nxdserve.sampling_params import SamplingParams
from tests.helpers.engine import PROMPTS, run_to_completion, shared_core, tokenize


def _params(max_tokens: int = 24, temperature: float = 0.0, seed: int | None = None, **spec: object) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))  # type: ignore[arg-type]


def test_choice_always_matches_and_finishes_with_stop() -> None:
    core = shared_core()
    prompts = tokenize(core, PROMPTS[:6])
    choices = ["yes", "no", "maybe not"]
    params = [_params(choice=choices, temperature=t, seed=i) for i, t in enumerate([0.0, 1.0, 1.5] * 2)]
    outs = run_to_completion(core, prompts, params)
    for out in outs:
        assert out.outputs[0].text in choices
        assert out.outputs[0].finish_reason == "stop"  # the grammar forced the end token
    assert not core.structured.active  # every matcher was released


def test_regex_always_matches_sampled() -> None:
    core = shared_core()
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    params = [_params(regex=pattern, temperature=1.0, seed=i, max_tokens=20) for i in range(8)]
    outs = run_to_completion(core, tokenize(core, PROMPTS[:8]), params)
    for out in outs:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text


def test_json_schema_documents_validate() -> None:
    core = shared_core()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    params = [_params(json=schema, max_tokens=40, temperature=0.7, seed=i, disable_any_whitespace=True)
              for i in range(4)]
    outs = run_to_completion(core, tokenize(core, PROMPTS[:4]), params)
    for out in outs:
        doc = json.loads(out.outputs[0].text)
        assert set(doc) == {"name", "age"} and isinstance(doc["age"], int) and isinstance(doc["name"], str)


def test_unconstrained_rows_in_the_same_batch_are_unchanged() -> None:
    core = shared_core()
    prompts = tokenize(core, PROMPTS[:2])
    alone = run_to_completion(core, prompts[1:], SamplingParams(temperature=0.0, max_tokens=12))
    mixed = run_to_completion(core, prompts, [_params(choice=["A", "B"]), SamplingParams(temperature=0.0,
                                                                                         max_tokens=12)])
    assert mixed[0].outputs[0].text in ("A", "B")
    assert mixed[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


@pytest.mark.parametrize(("spec", "fragment"), [
    ({"regex": "[a-"}, "regex"),
    ({"json": '{"type": "objectx"}'}, "json"),
    ({"json": "{not json"}, "JSON"),
    ({"grammar": "root ::= ("}, "grammar"),
])
def test_bad_spec_is_a_typed_error_naming_the_field(spec: dict[str, str], fragment: str) -> None:
    core = shared_core()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec, param="guided_x"))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError) as info:
        core.make_request([1, 2, 3], params)
    assert info.value.param == "guided_x" and fragment in info.value.message
    # and the engine keeps serving
    out = run_to_completion(core, tokenize(core, PROMPTS[:1]), _params(choice=["ok"]))
    assert out[0].outputs[0].text == "ok"


@pytest.mark.parametrize(("spec", "field"), [
    ({"choice": "yes"}, "choice"),  # a string is not three one-letter choices
    ({"json_object": "false"}, "json_object"),
    ({"json": {"type": "object"}, "disable_any_whitespace": "false"}, "disable_any_whitespace"),
    ({"regex": 123}, "regex"),
    ({"choice": ["a"], "whitespace_pattern": 5}, "whitespace_pattern"),
    ({"grammar": ["root ::= x"]}, "grammar"),
])
def test_a_field_of_the_wrong_type_is_an_error_naming_it(spec: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputsParams(**spec, param="structured_outputs")  # type: ignore[arg-type]
    assert info.value.param == "structured_outputs" and field in info.value.message


@pytest.mark.parametrize(("pattern", "accepted", "refused"), [
    (r"\d{3}", ["123"], ["\u0663\u0663\u0663", "\U0001fbf8\U0001fbf8\U0001fbf8"]),  # Arabic-Indic, segmented
    (r"[x\d]{2}\w", ["x1_", "12a"], ["x1\u00e9", "\u0663x_"]),
    (r"\D\W", ["a-", "a\u00e9"], ["1-", "a_"]),  # \u00e9 is not a word character in ASCII's classes
    (r"\\d", ["\\d"], ["1"]),  # an escaped backslash, then a literal d
])
def test_regex_classes_are_ascii_as_in_ecmascript(pattern: str, accepted: list[str], refused: list[str]) -> None:
    """``\\d`` and ``\\w`` mean [0-9] and [0-9A-Za-z_] (ECMAScript, JSON Schema, xgrammar), not Unicode's classes."""
    core = shared_core()
    compiler = core.structured.compiler
    tokenizer = compiler._hf_tokenizer
    for text, ok in [(t, True) for t in accepted] + [(t, False) for t in refused]:
        matcher = compiler.new_matcher(StructuredOutputsParams(regex=pattern))
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert (matcher.validate_tokens(ids) == len(ids)) == ok, (pattern, text)


def test_required_tool_calls_hold_only_name_and_parameters() -> None:
    from nxdserve.api.chat_output import _required_schema

    tools = {"f": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    compiler = shared_core().structured.compiler
    tokenizer = compiler._hf_tokenizer
    for text, ok in [('[{"name": "f", "parameters": {"a": 1}}]', True),
                     ('[{"name": "f", "parameters": {"a": 1}, "description": "x"}]', False),
                     ('[{"name": "g", "parameters": {}}]', False)]:
        matcher = compiler.new_matcher(StructuredOutputsParams(json=_required_schema(tools, parallel=True)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert (matcher.validate_tokens(ids) == len(ids)) == ok, text


def test_spec_needs_exactly_one_kind() -> None:
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputsParams(regex="a", choice=["a"], param="structured_outputs")
    assert info.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError):
        StructuredOutputsParams()


def test_compiled_grammars_are_cached_by_normalised_spec() -> None:
    core = shared_core()
    compiler = core.structured.compiler
    a = StructuredOutputsParams(json='{"type": "object", "properties": {"k": {"type": "integer"}}}')
    b = StructuredOutputsParams(json={"properties": {"k": {"type": "integer"}}, "type": "object"})
    before = compiler.num_compiled
    compiler.compile(a)
    compiler.compile(b)
    assert compiler.num_compiled == before + 1


def test_structural_tag_constrains_only_inside_its_tags() -> None:
    core = shared_core()
    spec = StructuredOutputsParams(structural_tag={
        "type": "structural_tag", "triggers": ["<f="],
        "structures": [{"begin": "<f=w>", "end": "</f>", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}]})

    def accepts(text: str) -> bool:
        matcher = core.structured.compiler.new_matcher(spec)
        return all(matcher.consume_token(t) for t in core.tokenizer.encode(text, add_special_tokens=False))

    assert accepts('free text <f=w>{"a": 5}</f> more text')
    assert not accepts('free text <f=w>{"a": "five"}')
