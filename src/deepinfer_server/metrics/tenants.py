"""The tenants family: each API key's admissions, running and queued requests."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from deepinfer_server.metrics.declare import Declarations, gauge_family

#: An API key's name, its requests in the engine and those waiting in the server's queue.
TenantCounts = Callable[[], Iterable[tuple[str, int, int]]]


class TenantMetrics:
    """Admission's view of each API key, by its name."""

    def __init__(self, declare: Declarations) -> None:
        self._declare = declare
        self._name = declare.model_name
        self.admissions = declare.counter(
            "tenant_admissions",
            "Requests each API key (by its name) sent, by admission's result (admitted, refused).",
            ["tenant", "result"],
        )

    def watch_tenants(self, tenant_counts: TenantCounts) -> None:
        """Expose each tenant's running and queued requests from `tenant_counts`."""
        self._declare.registry.register(_TenantGauges(self._name, tenant_counts))

    def observe_admission(self, tenant: str, admitted: bool) -> None:
        """A request of `tenant` that admission admitted or refused."""
        result = "admitted" if admitted else "refused"
        self.admissions.labels(self._name, tenant, result).inc()


class _TenantGauges(Collector):
    """Each API key's running and queued requests, read from admission at scrape time."""

    def __init__(self, model_name: str, tenant_counts: TenantCounts) -> None:
        self._model_name = model_name
        self._tenant_counts = tenant_counts

    def collect(self) -> Iterator[Metric]:
        running = gauge_family(
            "tenant_requests_running",
            "Requests of each API key (by its name) sent to the engine and not yet ended.",
            "tenant",
        )
        queued = gauge_family(
            "tenant_requests_queued",
            "Requests of each API key (by its name) waiting in the server's queue for a slot.",
            "tenant",
        )
        for tenant, in_engine, waiting in self._tenant_counts():
            running.add_metric([self._model_name, tenant], in_engine)
            queued.add_metric([self._model_name, tenant], waiting)
        yield running
        yield queued
