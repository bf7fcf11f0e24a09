"""Reading /metrics samples in tests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(base_url: str) -> Samples:
    """Every sample of /metrics, keyed by (name, labels)."""
    return parse_metrics(httpx.get(base_url + "/metrics", timeout=10).text)


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by (name, labels)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    labels.setdefault("model_name", "deepseek-flash")
    return samples.get((name, frozenset(labels.items())), 0.0)
