"""FastHistogram exposes the same Prometheus text as prometheus_client's own Histogram."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from deepinfer_server.metrics import FastHistogram, RequestRecord

BUCKETS = (0.01, 0.1, 1.0)
VALUES = [0.005, 0.01, 0.05, 0.5, 0.5, 2.0, 0.1]


def test_fast_histogram_matches_prometheus_client() -> None:
    reference_registry = CollectorRegistry()
    reference = Histogram("h", "doc", ["model_name"], buckets=BUCKETS, registry=reference_registry)
    fast_registry = CollectorRegistry()
    fast = FastHistogram("h", "doc", ["model_name"], BUCKETS)
    fast_registry.register(fast)
    for value in VALUES:
        reference.labels("m").observe(value)
    fast.labels("m").observe_many(VALUES[:3])
    for value in VALUES[3:]:
        fast.labels("m").observe(value)

    def series(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return sorted(
            line for line in text.splitlines() if line.startswith("h_") and "_created" not in line
        )

    assert series(fast_registry) == series(reference_registry)


def test_request_record_token_timing() -> None:
    record = RequestRecord(arrival=10.0)
    record.on_tokens(10.5, 2, step_seconds=0.01)  # first token plus one more in the same arrival
    record.on_tokens(11.0, 1, step_seconds=0.01)
    record.on_tokens(12.0, 4, step_seconds=0.01)
    assert record.ttft == 0.5
    assert record.generation_tokens == 7
    assert record.inter_token_latencies == [0.0, 0.5, 0.25, 0.25, 0.25, 0.25]
