"""JSON Schemas for the custom resources the Helm chart renders (prometheus-operator's ServiceMonitor, KEDA's
ScaledObject), taken from the cloudcoil model packages: pydantic models generated from each operator's CRD
openAPIV3Schema, released per operator version (cloudcoil-models-prometheus-operator, cloudcoil-models-keda).
Their JSON Schema keeps the CRD's types, required fields, enums and patterns.

One thing it does not keep: the models ignore unknown keys, while the API server rejects them under strict field
validation (kubectl's default). A structural CRD schema is either a record (``properties``) or a map
(``additionalProperties``), never both, and an opaque object is generated as a model without fields; so every
schema with declared properties is closed (``additionalProperties: false``), which is the server's rule."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import jsonschema
from cloudcoil.models.keda.v1alpha1 import ScaledObject
from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor
from jsonschema.exceptions import best_match
from pydantic import BaseModel

# (apiVersion, kind) -> (generated model, the distribution that ships it)
CRD_MODELS: dict[tuple[str, str], tuple[type[BaseModel], str]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): (ServiceMonitor, "cloudcoil-models-prometheus-operator"),
    ("keda.sh/v1alpha1", "ScaledObject"): (ScaledObject, "cloudcoil-models-keda"),
}
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not")


def close_records(schema: Any) -> None:
    """Set ``additionalProperties: false`` on every schema with declared properties, in place. Walks only the
    keywords that hold subschemas, so field names, defaults and enums are never mistaken for schemas."""
    if not isinstance(schema, dict):
        return
    if schema.get("properties") and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    for keyword, value in schema.items():
        if keyword in _SUBSCHEMA_MAPS:
            for sub in value.values():
                close_records(sub)
        elif keyword in _SUBSCHEMA_LISTS:
            for sub in value:
                close_records(sub)
        elif keyword in _SUBSCHEMAS:
            close_records(value)


def strict_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, mode="validation")
    close_records(schema)
    return schema


class CrdValidator:
    """Validates rendered custom resources against their CRD schemas (JSON Schema 2020-12, as pydantic writes)."""

    def __init__(self) -> None:
        self._validators: dict[tuple[str, str], jsonschema.Draft202012Validator] = {}
        for key, (model, _) in CRD_MODELS.items():
            schema = strict_schema(model)
            jsonschema.Draft202012Validator.check_schema(schema)
            self._validators[key] = jsonschema.Draft202012Validator(schema)

    def handles(self, obj: dict[str, Any]) -> bool:
        return (obj.get("apiVersion"), obj.get("kind")) in self._validators

    def errors(self, obj: dict[str, Any]) -> list[jsonschema.ValidationError]:
        return list(self._validators[obj["apiVersion"], obj["kind"]].iter_errors(obj))

    def validate(self, obj: dict[str, Any]) -> None:
        """Raises the most relevant ValidationError (its ``json_path`` names the field) when ``obj`` is invalid."""
        error = best_match(self.errors(obj))
        if error is not None:
            raise error


def schema_versions() -> dict[str, str]:
    """kind -> version of the model package (the operator's release, then cloudcoil's build number)."""
    return {kind: metadata.version(dist) for (_, kind), (_, dist) in CRD_MODELS.items()}
