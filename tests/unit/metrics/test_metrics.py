"""FastHistogram exposes the same Prometheus text as prometheus_client's own Histogram; request
records; the merged view of several API server processes' metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer_server.metrics import FastHistogram, RankLoad, RequestRecord, ServerMetrics
from deepinfer_server.metrics.aggregate import (
    Snapshot,
    merge_loads,
    merged_exposition,
    take_snapshot,
)

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


def _metrics_of_one_process(successes: int, running: int, kv_usage: float) -> ServerMetrics:
    metrics = ServerMetrics("m")
    metrics.watch_ranks(lambda: [RankLoad(0, running, 0, 10 * running, kv_usage)], lambda: True)
    for _ in range(successes):
        metrics.requests.success.labels("m", "stop").inc()
        metrics.requests.ttft.labels("m").observe(0.05)
    metrics.observe_step(0, 0.01)  # every process sees every step report
    return metrics


def test_merged_metrics_count_each_process_once_and_shared_views_once() -> None:
    answering = _metrics_of_one_process(successes=2, running=1, kv_usage=0.25)
    other = _metrics_of_one_process(successes=3, running=2, kv_usage=0.25)
    other.observe_failure(429)  # a series only the other process has
    snapshot = take_snapshot(other, [RankLoad(0, 2, 0, 20, 0.25)])
    text = merged_exposition(answering, [snapshot]).decode()
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, frozenset({"model_name": "m", **labels}.items()))]

    assert value("deepinfer:request_success_total", finished_reason="stop") == 5
    assert value("deepinfer:time_to_first_token_seconds_count") == 5
    assert value("deepinfer:time_to_first_token_seconds_bucket", le="0.06") == 5
    assert value("deepinfer:request_failure_total", status="429") == 1
    assert value("deepinfer:num_requests_running", dp_rank="0") == 3
    # What every process sees alike is not multiplied by the number of processes.
    assert value("deepinfer:engine_step_seconds_count", dp_rank="0") == 1
    assert value("deepinfer:kv_cache_usage_perc", dp_rank="0") == 0.25
    assert value("deepinfer:healthy") == 1


def test_merged_rank_loads_sum_requests_and_keep_own_kv_usage() -> None:
    own = [RankLoad(0, 1, 0, 10, 0.5), RankLoad(1, 0, 1, 7, 0.25)]
    other = Snapshot(rank_loads=[RankLoad(0, 2, 1, 30, 0.5), RankLoad(1, 1, 0, 5, 0.25)])
    assert merge_loads(own, [other]) == [RankLoad(0, 3, 1, 40, 0.5), RankLoad(1, 1, 1, 12, 0.25)]
