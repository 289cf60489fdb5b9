"""One Prometheus exposition for several engines: each engine's own vLLM-named series, with a label that says
which engine (``engine``, as vLLM's data-parallel server labels them; ``replica`` for Ray Serve replicas)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


def labelled_families(expositions: Mapping[str, str], label: str) -> list[Metric]:
    """Parse each source's text exposition and merge same-named families, each sample labelled
    ``label=<source key>``."""
    merged: dict[str, Metric] = {}
    for source, text in expositions.items():
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            target.samples.extend(
                Sample(s.name, {**s.labels, label: source}, s.value, s.timestamp, s.exemplar) for s in family.samples
            )
    return list(merged.values())


class LabelledCollector(Collector):
    """Collects the latest expositions ``source()`` returns (engine index or replica id -> text)."""

    def __init__(self, source: Callable[[], Mapping[str, str]], label: str) -> None:
        self._source = source
        self._label = label

    def collect(self) -> Iterator[Metric]:
        yield from labelled_families(self._source(), self._label)


def labelled_registry(source: Callable[[], Mapping[str, str]], label: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LabelledCollector(source, label))
    return registry
