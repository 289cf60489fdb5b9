"""What a request constrains its output to, with vLLM's ``StructuredOutputsParams`` fields."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from nxdserve.errors import InvalidRequestError

# The request field a constraint came from, for errors (the API sets it: "response_format", "guided_json", ...).
DEFAULT_PARAM = "structured_outputs"
# Each field's accepted types: a wrong type is a 400, never reinterpreted (a string is not a list of choices)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "json": (str, dict), "regex": (str,), "choice": (list, tuple), "grammar": (str,), "json_object": (bool,),
    "structural_tag": (str, dict), "disable_any_whitespace": (bool,), "disable_additional_properties": (bool,),
    "whitespace_pattern": (str,),
}


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF (EBNF) text
    json_object: bool | None = None  # any JSON object
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # Where the constraint came from (errors name it).
    param: str = DEFAULT_PARAM
    # The constraint starts after these tokens appear in the output (a reasoning model's end-of-thinking marker);
    # empty: from the first output token.
    start_after_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name, types in _FIELD_TYPES.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, types):
                wanted = " or ".join({"str": "a string", "dict": "an object", "list": "a list", "tuple": "a list",
                                      "bool": "a boolean"}[t.__name__] for t in types if t is not tuple)
                raise InvalidRequestError(f"{self.param}: {name} must be {wanted}, got {type(value).__name__}.",
                                          param=self.param)
        kinds = [name for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidRequestError(
                "Structured outputs take exactly one of json, regex, choice, grammar, json_object and "
                f"structural_tag; got {', '.join(kinds) or 'none'}.",
                param=self.param,
            )
        self.kind = kinds[0]
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of strings.", param=self.param)

    def key(self) -> str:
        """The normalised spec (the compile cache's key): equal constraints give equal keys."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag") and isinstance(value, str):
            with contextlib.suppress(json.JSONDecodeError):  # compile reports it
                value = json.loads(value)
        options = (self.disable_any_whitespace, self.disable_additional_properties, self.whitespace_pattern)
        return json.dumps([self.kind, value, options], sort_keys=True, separators=(",", ":"))

    def schema_text(self) -> str:
        """The JSON schema of a json / json_object constraint, as text."""
        if self.kind == "json_object":
            return '{"type": "object"}'
        value = self.json
        if isinstance(value, str):
            try:
                json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"The JSON schema is not valid JSON: {exc}", param=self.param) from exc
            return value
        return json.dumps(value)
