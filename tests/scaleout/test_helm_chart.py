"""The Helm chart in deploy/helm/nxdserve, rendered with Helm's own engine (helm-python-sdk binds Helm's Go SDK)
for each documented values set, every object validated against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields are errors), and the chart's promises checked on the result.

CRD objects (ServiceMonitor, ScaledObject) have no schema in kubernetes-validate: they are checked against the
fields their operators require (CRD_REQUIRED below), an explicit stand-in documented in docs/scale-out.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "nxdserve"
VALUES_SETS = ["default", *sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))]
KUBE_VERSIONS = ["1.30.0", "1.37.0"]  # the oldest EKS version the chart targets, and the newest schemas here
CRD_REQUIRED: dict[str, dict[str, type]] = {
    "ServiceMonitor": {"spec.selector.matchLabels": dict, "spec.endpoints": list},
    "ScaledObject": {"spec.scaleTargetRef.name": str, "spec.triggers": list},
}


def values_of(name: str) -> dict[str, Any]:
    return {} if name == "default" else yaml.safe_load((CHART / "ci" / name).read_text())


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="demo", namespace="llm")
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def dig(obj: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        obj = obj[key]
    return obj


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(values_of(name)) for name in VALUES_SETS}


def test_documented_values_sets_exist() -> None:
    assert len(VALUES_SETS) >= 4  # default + CPU + Neuron devices + Neuron cores with HPA


def test_lint_is_clean() -> None:
    for name in VALUES_SETS:
        report = helm.lint(str(CHART), values_of(name), strict=True, namespace="llm", kube_version="v1.30.0")
        assert not report["errors"], (name, report)
        assert not [m for m in report["messages"] if m["severity"] >= 2], (name, report["messages"])


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_object_is_valid(rendered: dict[str, list[dict[str, Any]]], kube_version: str) -> None:
    for name, objects in rendered.items():
        for obj in objects:
            if obj["kind"] in CRD_REQUIRED:
                for path, kind in CRD_REQUIRED[obj["kind"]].items():
                    assert isinstance(dig(obj, path), kind), (name, obj["kind"], path)
                continue
            kubernetes_validate.validate(obj, kube_version, strict=True)


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
