"""Reading /metrics samples in tests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(base_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of /metrics, keyed by (name, labels)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    labels.setdefault("model_name", "deepseek-flash")
    return samples.get((name, frozenset(labels.items())), 0.0)
