"""The disaggregation family: KV a decode server pulled from prefill servers (bytes, failures,
durations), the prompts a prefill server holds for decode servers, and the transport its
ranks move KV over."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from deepinfer_server.disaggregation.layout import KVLayout
from deepinfer_server.ipc.messages import EngineCounters
from deepinfer_server.metrics.declare import (
    LATENCY_BUCKETS,
    Declarations,
    counter_family,
    gauge_family,
)

_FAILURE_REASONS = ("timeout", "no_kv_room", "transfer_error", "kv_mismatch", "peer_unhealthy")


class TransferMetrics:
    """The KV transfer histograms, observed from the ranks' reports."""

    def __init__(self, declare: Declarations) -> None:
        self._name = declare.model_name
        self.kv_transfer_seconds = declare.histogram(
            "kv_transfer_seconds",
            "Duration of one KV pull from a prefill server (decode servers).",
            LATENCY_BUCKETS,
        )
        self.kv_transfer_wait_seconds = declare.histogram(
            "kv_transfer_wait_seconds",
            "Arrival of a decode request to its KV in place: the wait for KV room and the pull.",
            LATENCY_BUCKETS,
        )
        # Exported from the start on every server, so dashboards and alerts find the series.
        self.kv_transfer_seconds.labels(self._name)
        self.kv_transfer_wait_seconds.labels(self._name)

    def observe(self, counters: EngineCounters) -> None:
        """A rank's transfer samples since its last report."""
        name = self._name
        self.kv_transfer_seconds.labels(name).observe_many(counters.kv_transfer_seconds)
        self.kv_transfer_wait_seconds.labels(name).observe_many(counters.kv_transfer_wait_seconds)


def transfer_totals(labels: list[str], ranks: list[EngineCounters]) -> Iterator[Metric]:
    """The ranks' transfer totals, summed, each rank's as of its last report."""
    moved = counter_family(
        "kv_transfer_bytes",
        "KV bytes a decode server pulled from prefill servers, over every DP rank.",
    )
    failures = counter_family(
        "kv_transfer_failures",
        "KV transfers that failed on a decode server, by reason (timeout, no_kv_room, "
        "transfer_error, kv_mismatch, peer_unhealthy); on a prefill server, release notices "
        "ignored for want of a valid proof (release_unverified).",
        "reason",
    )
    held = gauge_family(
        "kv_transfer_held_requests",
        "Prefilled prompts a prefill server holds for decode servers now.",
    )
    moved.add_metric(labels, sum(c.kv_transfer_bytes for c in ranks))
    by_reason: dict[str, int] = dict.fromkeys(_FAILURE_REASONS, 0)
    for counters in ranks:
        for reason, count in counters.kv_transfer_failures.items():
            by_reason[reason] = by_reason.get(reason, 0) + count
    for reason, count in by_reason.items():
        failures.add_metric([*labels, reason], count)
    held.add_metric(labels, sum(c.held_kv for c in ranks))
    yield moved
    yield failures
    yield held


class TransportInfo(Collector):
    """`kv_transfer_transport_info{transport}` 1: the transport the ranks' transfer engines
    run (`--disaggregation-transport`, resolved), from the layout they reported ready with;
    absent on a server without a prefill or decode role."""

    def __init__(self, model_name: str, layout: Callable[[], KVLayout | None]) -> None:
        self._model_name = model_name
        self._layout = layout

    def collect(self) -> Iterator[Metric]:
        layout = self._layout()
        if layout is None or layout.transport is None:
            return
        info = gauge_family(
            "kv_transfer_transport_info",
            "1 for the transport (tcp, rdma or nvlink) the server's ranks move KV over.",
            "transport",
        )
        info.add_metric([self._model_name, layout.transport], 1.0)
        yield info
