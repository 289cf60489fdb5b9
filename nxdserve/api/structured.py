"""A request's structured-outputs constraint, from whichever field carries it: OpenAI's ``response_format``,
vLLM's ``structured_outputs`` body field, or vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``. Errors are 400s naming the field."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from nxdserve.api.errors import APIError
from nxdserve.api.protocol import SamplingRequest
from nxdserve.engine.structured import StructuredOutputsParams
from nxdserve.errors import InvalidRequestError

# Keys of vLLM's StructuredOutputsParams a request may send in ``structured_outputs``.
_SPEC_KEYS = frozenset({"json", "regex", "choice", "grammar", "json_object", "structural_tag",
                        "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"})
_IGNORED_KEYS = frozenset({"disable_fallback", "backend", "_backend", "_backend_was_auto"})
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
GUIDED_BACKENDS = frozenset({"auto", "guidance", "llguidance", "xgrammar", "outlines", "lm-format-enforcer"})


def _make(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(param=param, **fields)
    except InvalidRequestError as exc:
        raise APIError(exc.message, param=param) from exc
    except (TypeError, ValidationError) as exc:
        raise APIError(f"Invalid {param}: {exc}", param=param) from exc


def _from_response_format(req: SamplingRequest) -> StructuredOutputsParams | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _make("response_format", json_object=True)
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError("response_format json_schema needs a json_schema.schema.", param="response_format")
        return _make("response_format", json=fmt.json_schema.schema_)
    if fmt.type == "structural_tag":
        tag = {"structures": fmt.structures, "triggers": fmt.triggers}
        return _make("response_format", structural_tag=tag)
    raise APIError(
        f"response_format type {fmt.type!r} is not supported; use text, json_object, json_schema or structural_tag.",
        param="response_format",
    )


def _from_structured_outputs(raw: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if raw is None:
        return None
    unknown = set(raw) - _SPEC_KEYS - _IGNORED_KEYS
    if unknown:
        raise APIError(f"Unknown structured_outputs keys: {sorted(unknown)}.", param="structured_outputs")
    return _make("structured_outputs", **{k: v for k, v in raw.items() if k in _SPEC_KEYS and v is not None})


def _from_guided(req: SamplingRequest) -> StructuredOutputsParams | None:
    given = [name for name in GUIDED_FIELDS if getattr(req, name) is not None]
    if req.guided_decoding_backend is not None and req.guided_decoding_backend not in GUIDED_BACKENDS:
        raise APIError(f"Unknown guided_decoding_backend {req.guided_decoding_backend!r}.",
                       param="guided_decoding_backend")
    if not given:
        return None
    if len(given) > 1:
        raise APIError(f"Only one guided decoding field may be set; got {', '.join(given)}.", param=given[1])
    name = given[0]
    extra = {"whitespace_pattern": req.guided_whitespace_pattern} if req.guided_whitespace_pattern else {}
    return _make(name, **{GUIDED_FIELDS[name]: getattr(req, name)}, **extra)


def structured_outputs_of(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's one constraint, or None. Two fields that both constrain the output are a 400."""
    specs = [s for s in (_from_response_format(req), _from_structured_outputs(req.structured_outputs),
                         _from_guided(req)) if s is not None]
    if len(specs) > 1:
        raise APIError(
            f"A request may carry one structured-outputs constraint; got {specs[0].param} and {specs[1].param}.",
            param=specs[1].param,
        )
    return specs[0] if specs else None
