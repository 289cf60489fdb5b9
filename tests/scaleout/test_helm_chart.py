"""The Helm chart in deploy/helm/nxdserve, rendered with Helm's own engine (helm-python-sdk binds Helm's Go SDK)
for each documented values set, every object validated against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields are errors), and the chart's promises checked on the result.

CRD objects (ServiceMonitor, ScaledObject) have no schema in kubernetes-validate: they are validated against their
operators' CRD schemas (crd_schemas.py: JSON Schema from the cloudcoil model packages, unknown fields closed as the
API server's strict field validation does), and a misspelt field or a wrong type in each must fail."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.scaleout.crd_schemas import CrdValidator, close_records

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "nxdserve"
VALUES_SETS = ["default", *sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))]
KUBE_VERSIONS = ["1.30.0", "1.37.0"]  # the oldest EKS version the chart targets, and the newest schemas here


def values_of(name: str) -> dict[str, Any]:
    return {} if name == "default" else yaml.safe_load((CHART / "ci" / name).read_text())


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="demo", namespace="llm")
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(values_of(name)) for name in VALUES_SETS}


@pytest.fixture(scope="module")
def crds() -> CrdValidator:
    return CrdValidator()


def test_documented_values_sets_exist() -> None:
    assert len(VALUES_SETS) >= 4  # default + CPU + Neuron devices + Neuron cores with HPA


def test_lint_is_clean() -> None:
    for name in VALUES_SETS:
        report = helm.lint(str(CHART), values_of(name), strict=True, namespace="llm", kube_version="v1.30.0")
        assert not report["errors"], (name, report)
        assert not [m for m in report["messages"] if m["severity"] >= 2], (name, report["messages"])


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_builtin_object_is_valid(
    rendered: dict[str, list[dict[str, Any]]], crds: CrdValidator, kube_version: str
) -> None:
    for objects in rendered.values():
        for obj in objects:
            if not crds.handles(obj):
                kubernetes_validate.validate(obj, kube_version, strict=True)


def test_every_custom_resource_is_valid(rendered: dict[str, list[dict[str, Any]]], crds: CrdValidator) -> None:
    validated: set[str] = set()
    for name, objects in rendered.items():
        for obj in objects:
            if crds.handles(obj):
                assert not crds.errors(obj), (name, obj["kind"], [e.message for e in crds.errors(obj)])
                validated.add(obj["kind"])
    assert validated == {"ServiceMonitor", "ScaledObject"}  # every CRD kind the chart has was rendered and checked


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def test_probes_drain_and_grace(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name in VALUES_SETS:
        values = values_of(name)
        drain = values.get("server", {}).get("drainTimeoutSeconds", 30)
        pod = by_kind(rendered[name], "Deployment")["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert f"--drain-timeout={drain}" in container["args"]
        sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        # The pod gets the preStop sleep, the whole drain and a margin before the kubelet kills it.
        assert pod["terminationGracePeriodSeconds"] >= sleep + drain + 5


def test_neuron_resources_cache_and_model(rendered: dict[str, list[dict[str, Any]]]) -> None:
    neuron = by_kind(rendered["neuron-values.yaml"], "Deployment")["spec"]["template"]["spec"]
    (container,) = neuron["containers"]
    assert container["resources"]["limits"]["aws.amazon.com/neuron"] == "4"
    assert "--tensor-parallel-size=8" in container["args"] and "--backend=nxd" in container["args"]
    assert {"name": "NXDSERVE_CACHE_DIR", "value": "/cache"} in container["env"]
    cache = next(v for v in neuron["volumes"] if v["name"] == "compile-cache")
    assert cache["persistentVolumeClaim"]["claimName"] == "neuron-compile-cache-efs"
    (init,) = neuron["initContainers"]
    assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]
    cores = by_kind(rendered["neuron-cores-hpa-values.yaml"], "Deployment")["spec"]["template"]["spec"]
    assert cores["containers"][0]["resources"]["limits"]["aws.amazon.com/neuroncore"] == "4"
    assert cores["schedulerName"] == "my-scheduler"
    cpu = by_kind(rendered["default"], "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert not [r for r in cpu["resources"]["limits"] if r.startswith("aws.amazon.com/")]


def test_metrics_and_autoscaling(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert {o["kind"] for o in rendered["default"]} == {"Deployment", "Service"}
    cpu = rendered["cpu-values.yaml"]
    endpoint = by_kind(cpu, "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "http"
    assert {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "replica"} in endpoint["relabelings"]
    trigger = by_kind(cpu, "ScaledObject")["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "5"
    assert 'vllm:num_requests_waiting{namespace="llm",service="demo-nxdserve"}' in trigger["metadata"]["query"]
    assert "replicas" not in by_kind(cpu, "Deployment")["spec"]  # the autoscaler owns the count
    hpa = by_kind(rendered["neuron-cores-hpa-values.yaml"], "HorizontalPodAutoscaler")["spec"]
    assert hpa["metrics"][0]["external"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert hpa["metrics"][0]["external"]["target"] == {"type": "AverageValue", "averageValue": "4"}


def test_bad_values_fail_to_render() -> None:
    with pytest.raises(helm.HelmError, match=r"model\.existingClaim is required"):
        render({"model": {"source": "volume"}})
    with pytest.raises(helm.HelmError, match=r"accelerator\.type must be cpu or neuron"):
        render({"accelerator": {"type": "gpu"}})


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def rename(obj: dict[str, Any], old: str, new: str) -> None:
    obj[new] = obj.pop(old)


# (kind, values on top of ci/cpu-values.yaml, change to the rendered object, the failing field, its JSON path)
BAD_CUSTOM_RESOURCES = {
    "ServiceMonitor misspelt endpoint field": (
        "ServiceMonitor", {}, lambda o: rename(o["spec"]["endpoints"][0], "relabelings", "relabellings"),
        "relabellings", "$.spec.endpoints[0]",
    ),
    "ServiceMonitor misspelt spec field": (
        "ServiceMonitor", {}, lambda o: rename(o["spec"], "namespaceSelector", "namespaceSelecter"),
        "namespaceSelecter", "$.spec",
    ),
    "ServiceMonitor misspelt metadata field": (
        "ServiceMonitor", {}, lambda o: rename(o["metadata"], "labels", "label"), "label", "$.metadata",
    ),
    "ServiceMonitor interval as a number": (
        "ServiceMonitor", {"serviceMonitor": {"interval": 30}}, None, "30", "$.spec.endpoints[0].interval",
    ),
    "ServiceMonitor interval not a duration": (
        "ServiceMonitor", {"serviceMonitor": {"interval": "30 seconds"}}, None, "30 seconds",
        "$.spec.endpoints[0].interval",
    ),
    "ScaledObject misspelt spec field (the HPA's name)": (
        "ScaledObject", {}, lambda o: rename(o["spec"], "minReplicaCount", "minReplicas"), "minReplicas", "$.spec",
    ),
    "ScaledObject misspelt target field": (
        "ScaledObject", {}, lambda o: rename(o["spec"]["scaleTargetRef"], "name", "nme"), "nme",
        "$.spec.scaleTargetRef",
    ),
    "ScaledObject pollingInterval as a duration string": (
        "ScaledObject", {"autoscaling": {"keda": {"pollingInterval": "15s"}}}, None, "15s", "$.spec.pollingInterval",
    ),
    "ScaledObject trigger threshold unquoted": (
        "ScaledObject", {}, lambda o: o["spec"]["triggers"][0]["metadata"].update(threshold=5), "5",
        "$.spec.triggers[0].metadata.threshold",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CUSTOM_RESOURCES))
def test_bad_custom_resources_fail_validation(
    rendered: dict[str, list[dict[str, Any]]], crds: CrdValidator, case: str
) -> None:
    kind, values, mutate, field, path = BAD_CUSTOM_RESOURCES[case]
    good = by_kind(rendered["cpu-values.yaml"], kind)
    assert not crds.errors(good)  # only the change below is wrong
    obj = by_kind(render(merged(values_of("cpu-values.yaml"), values)), kind) if values else copy.deepcopy(good)
    if mutate is not None:
        mutate(obj)
    errors = crds.errors(obj)
    assert [e for e in errors if e.json_path == path and field in e.message], (case, [e.message for e in errors])
    with pytest.raises(jsonschema.ValidationError):
        crds.validate(obj)


def test_closing_rejects_unknown_record_fields_and_keeps_maps_open() -> None:
    record = {"type": "object", "properties": {"b": {"type": "integer"}}}
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "string"}}},  # a field so named
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},  # a map
            "raw": {"type": "object", "properties": {}},  # an opaque object: a model without fields
            "ref": {"anyOf": [{"$ref": "#/$defs/Record"}, {"type": "null"}], "default": {"properties": {}}},
        },
        "$defs": {"Record": record},
    }
    close_records(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"properties": {"a": "x"}, "labels": {"k": "v"}, "raw": {"any": 1}, "ref": {"b": 1}})
    for bad in ({"propertie": {}}, {"properties": {"a": "x", "z": 1}}, {"ref": {"b": 1, "c": 2}}, {"labels": {"k": 1}}):
        assert not validator.is_valid(bad), bad
    assert schema["properties"]["ref"]["default"] == {"properties": {}}  # data is never taken for a schema
