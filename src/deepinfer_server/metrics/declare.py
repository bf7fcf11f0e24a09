"""The shapes every metric family declares its metrics with: one place for the name prefix,
the `model_name` label and the registry they go to."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deepinfer_server.metrics.histogram import FastHistogram

PREFIX = "deepinfer:"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# Seconds from arrival (time to first token, end to end, queueing, KV pulls).
LATENCY_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0),
    *(2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1),
    *(0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
)
STEP_BUCKETS = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1),
    *(0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
TOKEN_BUCKETS = (
    *(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000),
    *(10000, 20000, 50000, 100000, 200000),
)


def gauge_family(name: str, doc: str, *extra: str) -> GaugeMetricFamily:
    """A gauge read at scrape time, labelled `model_name` and then `extra`."""
    return GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", *extra])


def counter_family(name: str, doc: str, *extra: str) -> CounterMetricFamily:
    """A counter read at scrape time, labelled `model_name` and then `extra`."""
    return CounterMetricFamily(PREFIX + name, doc, labels=["model_name", *extra])


class Declarations:
    """Declares the metrics a server observes itself, in its registry, for its model."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name

    def histogram(
        self, name: str, doc: str, buckets: Sequence[float], extra: Sequence[str] = ()
    ) -> FastHistogram:
        """A histogram labelled `model_name` and then `extra`."""
        metric = FastHistogram(PREFIX + name, doc, ["model_name", *extra], tuple(buckets))
        self.registry.register(metric)
        return metric

    def counter(
        self, name: str, doc: str, extra: Sequence[str] = (), values: Iterable[str] = ()
    ) -> Counter:
        """A counter labelled `model_name` and then `extra`, its series for each of `values`
        (of its one extra label) exported from the start so dashboards and alerts find them."""
        metric = Counter(PREFIX + name, doc, ["model_name", *extra], registry=self.registry)
        for value in values:
            metric.labels(self.model_name, value)
        return metric

    def gauge(self, name: str, doc: str, extra: Sequence[str] = ()) -> Gauge:
        """A gauge labelled `model_name` and then `extra`, its series read from callables."""
        return Gauge(PREFIX + name, doc, ["model_name", *extra], registry=self.registry)
