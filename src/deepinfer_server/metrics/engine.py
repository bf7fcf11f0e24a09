"""The engine family: each DP rank's load, KV-cache usage, health and step time, and the ranks'
own totals (prompt tokens computed, with the disaggregation and speculation families')."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from deepinfer_server.ipc.messages import EngineCounters, PrefixCacheStats
from deepinfer_server.metrics.declare import (
    STEP_BUCKETS,
    Declarations,
    counter_family,
    gauge_family,
)
from deepinfer_server.metrics.disaggregation import TransferMetrics, transfer_totals
from deepinfer_server.metrics.prefix_cache import PrefixCacheFamilies
from deepinfer_server.metrics.speculation import speculation_totals


class RankLoad(NamedTuple):
    """What one DP rank holds now: the gauges GIE's endpoint picker and the routers read.

    `waiting` counts requests admitted to the rank that the engine has not yet scheduled
    (no first token), `running` those producing tokens, `tokens` the prompt and generated
    tokens of both; `kv_cache_usage` is the share (0-1)
    of the rank's KV cache in use at its last step report (None before one, or when the
    engine cannot tell), `prefix_cache` its prefix-cache counters then (None without a cache).
    """

    rank: int
    running: int
    waiting: int
    tokens: int
    kv_cache_usage: float | None
    prefix_cache: PrefixCacheStats | None = None


class EngineMetrics:
    """What the ranks report: step times, their totals and the KV transfers' samples."""

    def __init__(self, declare: Declarations) -> None:
        self._declare = declare
        self._name = declare.model_name
        self.step_seconds = declare.histogram(
            "engine_step_seconds",
            "Duration of one engine iteration on a DP rank.",
            STEP_BUCKETS,
            ["dp_rank"],
        )
        self.routing = declare.counter(
            "dp_routing",
            "Requests the API process sent to each DP rank (with DP > 1), by why it chose that "
            "rank: session (the rank of the request's session), prefix (the rank holding its "
            "prompt's prefix) or load (the least-loaded rank).",
            ["reason", "dp_rank"],
        )
        self.transfers = TransferMetrics(declare)
        #: Each rank's last reported totals (None before its first report).
        self._totals: list[EngineCounters | None] = []
        declare.registry.register(_EngineTotals(self._name, self._totals))

    def watch_ranks(
        self, rank_loads: Callable[[], Iterable[RankLoad]], healthy: Callable[[], bool]
    ) -> None:
        """Expose the per-rank gauges and health from these callables."""
        self._declare.registry.register(_RankGauges(self._name, rank_loads, healthy))

    def observe_step(self, rank: int, seconds: float) -> None:
        """One engine iteration of `rank`."""
        self.step_seconds.labels(self._name, str(rank)).observe(seconds)

    def observe_routing(self, rank: int, reason: str) -> None:
        """A request sent to `rank`, for `reason`."""
        self.routing.labels(self._name, reason, str(rank)).inc()

    def observe_counters(self, rank: int, counters: EngineCounters) -> None:
        """A rank's disaggregation report: its totals, and its new transfer samples."""
        totals = self._totals
        totals.extend([None] * (rank + 1 - len(totals)))
        totals[rank] = counters
        self.transfers.observe(counters)


class _RankGauges(Collector):
    """Per-rank load gauges and health, read from the coordinator at scrape time."""

    def __init__(
        self,
        model_name: str,
        rank_loads: Callable[[], Iterable[RankLoad]],
        healthy: Callable[[], bool],
    ) -> None:
        self._model_name = model_name
        self._rank_loads = rank_loads
        self._healthy = healthy

    def collect(self) -> Iterator[Metric]:
        running = gauge_family(
            "num_requests_running", "Requests producing tokens on each DP rank.", "dp_rank"
        )
        waiting = gauge_family(
            "num_requests_waiting",
            "Requests admitted to each DP rank that have no first token yet.",
            "dp_rank",
        )
        kv_usage = gauge_family(
            "kv_cache_usage_perc",
            "KV-cache usage of each DP rank (1 = full), at its last engine step.",
            "dp_rank",
        )
        prefix_cache = PrefixCacheFamilies(self._model_name)
        for load in self._rank_loads():
            labels = [self._model_name, str(load.rank)]
            running.add_metric(labels, load.running)
            waiting.add_metric(labels, load.waiting)
            kv_usage.add_metric(labels, load.kv_cache_usage or 0.0)
            prefix_cache.add(labels, load.prefix_cache)
        healthy = gauge_family("healthy", "1 while every DP rank is alive and stepping, else 0.")
        healthy.add_metric([self._model_name], 1.0 if self._healthy() else 0.0)
        yield running
        yield waiting
        yield kv_usage
        yield from prefix_cache.families()
        yield healthy


class _EngineTotals(Collector):
    """The ranks' own totals (prompt tokens computed, KV transfer bytes and failures,
    speculative decoding's drafts), summed over the ranks, each rank's as of its last report."""

    def __init__(self, model_name: str, ranks: list[EngineCounters | None]) -> None:
        self._model_name = model_name
        self._ranks = ranks

    def collect(self) -> Iterator[Metric]:
        labels = [self._model_name]
        computed = counter_family(
            "prompt_tokens_computed",
            "Prompt tokens the engine actually prefilled (prefix-cache hits and KV pulled "
            "from a prefill server excluded), over every DP rank.",
        )
        ranks = [counters for counters in self._ranks if counters is not None]
        computed.add_metric(labels, sum(c.prompt_tokens_computed for c in ranks))
        yield computed
        yield from transfer_totals(labels, ranks)
        yield from speculation_totals(labels, ranks)
