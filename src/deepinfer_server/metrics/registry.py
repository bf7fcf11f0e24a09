"""ServerMetrics: the Prometheus metrics of one server, owned by the API process.

Every series is named `deepinfer:<name>` and labelled with `model_name`, as vLLM names them.
The API process is the only owner, so the numbers stay right with any number of DP ranks:
request metrics are observed where requests end, engine metrics from each rank's step reports,
and the per-rank gauges are read from the coordinator at scrape time. Each family (requests,
engine with its prefix-cache, disaggregation and speculation families, stored and background
work, tenants, grammar) declares and collects its own metrics; this registry composes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import prometheus_client
from prometheus_client import CollectorRegistry

from deepinfer_server.disaggregation.layout import KVLayout
from deepinfer_server.ipc.messages import AbortReason, EngineCounters
from deepinfer_server.metrics.background import BackgroundMetrics
from deepinfer_server.metrics.declare import CONTENT_TYPE, PREFIX, Declarations
from deepinfer_server.metrics.disaggregation import TransportInfo
from deepinfer_server.metrics.engine import EngineMetrics, RankLoad
from deepinfer_server.metrics.grammar import CompileQueueCounts, CompileQueueGauges
from deepinfer_server.metrics.records import RequestRecord
from deepinfer_server.metrics.requests import RequestMetrics
from deepinfer_server.metrics.tenants import TenantCounts, TenantMetrics

__all__ = ["CONTENT_TYPE", "PREFIX", "CompileQueueCounts", "RankLoad", "ServerMetrics"]


class ServerMetrics:
    """All metrics of one server in a registry of its own."""

    def __init__(self, model_name: str) -> None:
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self.model_name = model_name
        declare = Declarations(self.registry, model_name)
        self.requests = RequestMetrics(declare)
        self.engine = EngineMetrics(declare)
        self.background = BackgroundMetrics(declare)
        self.tenants = TenantMetrics(declare)

    def watch_ranks(
        self, rank_loads: Callable[[], Iterable[RankLoad]], healthy: Callable[[], bool]
    ) -> None:
        """Expose the per-rank gauges and health from these callables."""
        self.engine.watch_ranks(rank_loads, healthy)

    def watch_transport(self, layout: Callable[[], KVLayout | None]) -> None:
        """Expose the KV transport of the layout `layout` returns (once the ranks reported)."""
        self.registry.register(TransportInfo(self.model_name, layout))

    def watch_compile_queue(
        self, counts: Callable[[], CompileQueueCounts | None], warm: Callable[[], bool]
    ) -> None:
        """Expose the grammar compile queue's gauges and refusals from `counts`, and whether
        structured output is warm from `warm`."""
        self.registry.register(CompileQueueGauges(self.model_name, counts, warm))

    def watch_receive_buffer(self, used: Callable[[], float]) -> None:
        """Expose the bytes held by requests still being received, read from `used`."""
        self.requests.watch_receive_buffer(used)

    def watch_background(self, counts: Callable[[], dict[str, int]]) -> None:
        """Expose this process's background responses by status (queued, in_progress), read
        from `counts`."""
        self.background.watch_background(counts)

    def watch_batches(self, running: Callable[[], int]) -> None:
        """Expose the batch requests this process is answering, read from `running`."""
        self.background.watch_batches(running)

    def watch_tenants(self, tenant_counts: TenantCounts) -> None:
        """Expose each tenant's running and queued requests from `tenant_counts`."""
        self.tenants.watch_tenants(tenant_counts)

    def observe_batch_line(self, result: str) -> None:
        """A batch request this server took off a batch, by its result."""
        self.background.observe_batch_line(result)

    def observe_batch_end(self, status: str) -> None:
        """A batch this server ended with `status`."""
        self.background.observe_batch_end(status)

    def observe_background_end(self, status: str) -> None:
        """A background response that ended with `status`."""
        self.background.observe_background_end(status)

    def observe_store_write(self, failed: bool) -> None:
        """A response written to the store, or a write that failed."""
        self.background.observe_store_write(failed)

    def observe_admission(self, tenant: str, admitted: bool) -> None:
        """A request of `tenant` that admission admitted or refused."""
        self.tenants.observe_admission(tenant, admitted)

    def observe_counters(self, rank: int, counters: EngineCounters) -> None:
        """A rank's disaggregation report: its totals, and its new transfer samples."""
        self.engine.observe_counters(rank, counters)

    def observe_routing(self, rank: int, reason: str) -> None:
        """A request the coordinator sent to DP rank `rank`, for `reason` (session, prefix,
        load)."""
        self.engine.observe_routing(rank, reason)

    def observe_step(self, rank: int, seconds: float) -> None:
        """One engine iteration of `rank`."""
        self.engine.observe_step(rank, seconds)

    def observe_failure(self, status: int) -> None:
        """A request answered with an error status."""
        self.requests.observe_failure(status)

    def observe_abort(self, reason: AbortReason) -> None:
        """An engine request cut short."""
        self.requests.observe_abort(reason)

    def observe_engine_request(self, record: RequestRecord) -> None:
        """Token counters and latency histograms of a request that reached the engine."""
        self.requests.observe_engine_request(record)

    def observe_success(self, record: RequestRecord, now: float) -> None:
        """A request that finished normally at `now`."""
        self.requests.observe_success(record, now)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return bytes(prometheus_client.generate_latest(self.registry))
