"""Upstream-shaped metric objects (vllm.v1.metrics.reader) read from a Prometheus registry.

`LLM.get_metrics()` returns these, read from the same registry that `/metrics` renders, so the
two never disagree. Names are the metric family names (counters without `_total`, as
prometheus_client reports them); a counter with a `position` label becomes one Vector.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound ("le") -> cumulative count


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "counter":
            samples = [s for s in family.samples if s.name.endswith("_total")]
            if any("position" in s.labels for s in samples):
                by_labels: dict[tuple, dict[int, float]] = {}
                for sample in samples:
                    labels = {k: v for k, v in sample.labels.items() if k != "position"}
                    key = tuple(sorted(labels.items()))
                    by_labels.setdefault(key, {})[int(sample.labels["position"])] = sample.value
                for key, values in by_labels.items():
                    out.append(Vector(family.name, dict(key),
                                      [int(values[i]) for i in sorted(values)]))
            else:
                out += [Counter(family.name, dict(s.labels), int(s.value)) for s in samples]
        elif family.type == "gauge":
            out += [Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples]
        elif family.type == "histogram":
            groups: dict[tuple, dict] = {}
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k != "le"}
                entry = groups.setdefault(tuple(sorted(labels.items())),
                                          {"buckets": {}, "count": 0, "sum": 0.0})
                if sample.name.endswith("_bucket"):
                    entry["buckets"][sample.labels["le"]] = int(sample.value)
                elif sample.name.endswith("_count"):
                    entry["count"] = int(sample.value)
                elif sample.name.endswith("_sum"):
                    entry["sum"] = float(sample.value)
            for key, entry in groups.items():
                out.append(Histogram(family.name, dict(key), entry["count"], entry["sum"],
                                     entry["buckets"]))
    return out
