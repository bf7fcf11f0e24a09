"""ServerMetrics: the Prometheus metrics of one server, owned by the API process.

Every series is named `deepinfer:<name>` and labelled with `model_name`, as vLLM names them.
The API process is the only owner, so the numbers stay right with any number of DP ranks:
request metrics are observed where requests end, engine metrics from each rank's step reports,
and the per-rank gauges are read from the coordinator at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple, Protocol

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepinfer_server.ipc.messages import AbortReason, EngineCounters, PrefixCacheStats
from deepinfer_server.metrics.histogram import FastHistogram
from deepinfer_server.metrics.records import RequestRecord

PREFIX = "deepinfer:"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
_STEP_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_TOKEN_BUCKETS = (
    1,
    2,
    5,
    10,
    20,
    50,
    100,
    200,
    500,
    1000,
    2000,
    5000,
    10000,
    20000,
    50000,
    100000,
    200000,
)


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
        running = GaugeMetricFamily(
            PREFIX + "num_requests_running",
            "Requests producing tokens on each DP rank.",
            labels=["model_name", "dp_rank"],
        )
        waiting = GaugeMetricFamily(
            PREFIX + "num_requests_waiting",
            "Requests admitted to each DP rank that have no first token yet.",
            labels=["model_name", "dp_rank"],
        )
        kv_usage = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc",
            "KV-cache usage of each DP rank (1 = full), at its last engine step.",
            labels=["model_name", "dp_rank"],
        )
        # The prefix-cache counters are tokens, as vLLM's `prefix_cache_queries` and
        # `prefix_cache_hits` count them: summed over the ranks, each rank's as of its last
        # step report (every API process hears every rank, so they are never summed over
        # processes).
        queries = CounterMetricFamily(
            PREFIX + "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache, over every DP rank.",
            labels=["model_name"],
        )
        hits = CounterMetricFamily(
            PREFIX + "prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not computed again), over every DP rank.",
            labels=["model_name"],
        )
        sequences = GaugeMetricFamily(
            PREFIX + "prefix_cache_sequences",
            "Sequences held in each DP rank's prefix cache, at its last engine step.",
            labels=["model_name", "dp_rank"],
        )
        total_queries = total_hits = 0
        for load in self._rank_loads():
            labels = [self._model_name, str(load.rank)]
            running.add_metric(labels, load.running)
            waiting.add_metric(labels, load.waiting)
            kv_usage.add_metric(labels, load.kv_cache_usage or 0.0)
            cache = load.prefix_cache
            sequences.add_metric(labels, cache.sequences if cache is not None else 0)
            if cache is not None:
                total_queries += cache.queries
                total_hits += cache.hits
        queries.add_metric([self._model_name], total_queries)
        hits.add_metric([self._model_name], total_hits)
        healthy = GaugeMetricFamily(
            PREFIX + "healthy",
            "1 while every DP rank is alive and stepping, else 0.",
            labels=["model_name"],
        )
        healthy.add_metric([self._model_name], 1.0 if self._healthy() else 0.0)
        yield running
        yield waiting
        yield kv_usage
        yield queries
        yield hits
        yield sequences
        yield healthy


class CompileQueueCounts(Protocol):
    """The grammar compile queue's counts (`grammar.compile_queue.QueueStats`)."""

    @property
    def waiting(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def refused_per_key(self) -> int: ...
    @property
    def refused_busy(self) -> int: ...
    @property
    def workers_ready(self) -> int: ...


class _CompileQueueGauges(Collector):
    """The grammar compile queue of this API server process, read at scrape time."""

    def __init__(self, model_name: str, counts: Callable[[], CompileQueueCounts | None]) -> None:
        self._model_name = model_name
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        labels = [self._model_name]
        waiting = GaugeMetricFamily(
            PREFIX + "grammar_compiles_waiting",
            "Structured-output grammars waiting for a compile worker.",
            labels=["model_name"],
        )
        running = GaugeMetricFamily(
            PREFIX + "grammar_compiles_running",
            "Structured-output grammars compiling in a compile worker.",
            labels=["model_name"],
        )
        refused = CounterMetricFamily(
            PREFIX + "grammar_compile_refusals",
            "Grammars refused for want of compile capacity: per_key (429, the API key's "
            "queued compiles at their bound), capacity (503, no worker free in time).",
            labels=["model_name", "reason"],
        )
        workers = GaugeMetricFamily(
            PREFIX + "grammar_compile_workers_ready",
            "Grammar compile workers started and alive (0 while they are prepared after "
            "start-up: a structured request then waits for them).",
            labels=["model_name"],
        )
        workers.add_metric(labels, counts.workers_ready if counts else 0)
        waiting.add_metric(labels, counts.waiting if counts else 0)
        running.add_metric(labels, counts.running if counts else 0)
        refused.add_metric([*labels, "per_key"], counts.refused_per_key if counts else 0)
        refused.add_metric([*labels, "capacity"], counts.refused_busy if counts else 0)
        yield workers
        yield waiting
        yield running
        yield refused


class _TenantGauges(Collector):
    """Each API key's running and queued requests, read from admission at scrape time."""

    def __init__(
        self, model_name: str, tenant_counts: Callable[[], Iterable[tuple[str, int, int]]]
    ) -> None:
        self._model_name = model_name
        self._tenant_counts = tenant_counts

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            PREFIX + "tenant_requests_running",
            "Requests of each API key (by its name) sent to the engine and not yet ended.",
            labels=["model_name", "tenant"],
        )
        queued = GaugeMetricFamily(
            PREFIX + "tenant_requests_queued",
            "Requests of each API key (by its name) waiting in the server's queue for a slot.",
            labels=["model_name", "tenant"],
        )
        for tenant, in_engine, waiting in self._tenant_counts():
            running.add_metric([self._model_name, tenant], in_engine)
            queued.add_metric([self._model_name, tenant], waiting)
        yield running
        yield queued


class _EngineTotals(Collector):
    """The ranks' own totals (prompt tokens computed, KV transfer bytes and failures,
    speculative decoding's drafts), summed over the ranks, each rank's as of its last report."""

    def __init__(self, model_name: str, ranks: list[EngineCounters | None]) -> None:
        self._model_name = model_name
        self._ranks = ranks

    def collect(self) -> Iterator[Metric]:
        labels = [self._model_name]
        computed = CounterMetricFamily(
            PREFIX + "prompt_tokens_computed",
            "Prompt tokens the engine actually prefilled (prefix-cache hits and KV pulled "
            "from a prefill server excluded), over every DP rank.",
            labels=["model_name"],
        )
        moved = CounterMetricFamily(
            PREFIX + "kv_transfer_bytes",
            "KV bytes a decode server pulled from prefill servers, over every DP rank.",
            labels=["model_name"],
        )
        failures = CounterMetricFamily(
            PREFIX + "kv_transfer_failures",
            "KV transfers that failed on a decode server, by reason (timeout, no_kv_room, "
            "transfer_error, kv_mismatch).",
            labels=["model_name", "reason"],
        )
        held = GaugeMetricFamily(
            PREFIX + "kv_transfer_held_requests",
            "Prefilled prompts a prefill server holds for decode servers now.",
            labels=["model_name"],
        )
        ranks = [counters for counters in self._ranks if counters is not None]
        computed.add_metric(labels, sum(c.prompt_tokens_computed for c in ranks))
        moved.add_metric(labels, sum(c.kv_transfer_bytes for c in ranks))
        by_reason: dict[str, int] = dict.fromkeys(
            ("timeout", "no_kv_room", "transfer_error", "kv_mismatch"), 0
        )
        for counters in ranks:
            for reason, count in counters.kv_transfer_failures.items():
                by_reason[reason] = by_reason.get(reason, 0) + count
        for reason, count in by_reason.items():
            failures.add_metric([*labels, reason], count)
        held.add_metric(labels, sum(c.held_kv for c in ranks))
        yield computed
        yield moved
        yield failures
        yield held
        yield from _speculation(labels, ranks)


def _speculation(labels: list[str], ranks: list[EngineCounters]) -> Iterator[Metric]:
    """Speculative decoding's counters, named as vLLM's (zero while it is off)."""
    families = (
        ("spec_decode_num_drafts", "Decode steps of a sequence that verified draft tokens."),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted (emitted as output)."),
    )
    totals = (
        sum(c.spec_drafts for c in ranks),
        sum(c.spec_draft_tokens for c in ranks),
        sum(c.spec_accepted_tokens for c in ranks),
    )
    for (name, doc), total in zip(families, totals, strict=True):
        family = CounterMetricFamily(
            PREFIX + name, doc + " Over every DP rank.", labels=["model_name"]
        )
        family.add_metric(labels, total)
        yield family
    per_position = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each draft position (0: the first draft of a step), over "
        "every DP rank.",
        labels=["model_name", "position"],
    )
    by_position: list[int] = []
    for counters in ranks:
        for position, count in enumerate(counters.spec_accepted_per_position):
            if position == len(by_position):
                by_position.append(0)
            by_position[position] += count
    for position, count in enumerate(by_position):
        per_position.add_metric([*labels, str(position)], count)
    yield per_position


class ServerMetrics:
    """All metrics of one server in a registry of its own."""

    def __init__(self, model_name: str) -> None:
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...], extra: list[str] | None = None
        ) -> FastHistogram:
            metric = FastHistogram(PREFIX + name, doc, [*labels, *(extra or [])], buckets)
            self.registry.register(metric)
            return metric

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *(extra or [])], registry=self.registry)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to the last token.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Admission to the start of the engine step that produced the first token.",
            _LATENCY_BUCKETS,
        )
        self.prompt_tokens_hist = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.generation_tokens_hist = histogram(
            "request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        self.step_seconds = histogram(
            "engine_step_seconds",
            "Duration of one engine iteration on a DP rank.",
            _STEP_BUCKETS,
            ["dp_rank"],
        )
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of requests sent to the engine."
        )
        self.generation_tokens = counter("generation_tokens", "Tokens generated for clients.")
        self.success = counter(
            "request_success", "Requests that finished normally.", ["finished_reason"]
        )
        self.failure = counter(
            "request_failure", "Requests answered with an error, by HTTP status.", ["status"]
        )
        self.aborts = counter("request_abort", "Engine requests cut short, by reason.", ["reason"])
        for reason in AbortReason:
            self.aborts.labels(model_name, reason.value)
        self.store_writes = counter(
            "response_store_writes",
            "Responses written to the Responses store, by result (stored, failed).",
            ["result"],
        )
        for result in ("stored", "failed"):
            self.store_writes.labels(model_name, result)
        self.background_ended = counter(
            "background_responses_finished",
            "Background responses that ended, by status (completed, incomplete, failed, "
            "cancelled).",
            ["status"],
        )
        for status in ("completed", "incomplete", "failed", "cancelled"):
            self.background_ended.labels(model_name, status)
        self.batch_lines = counter(
            "batch_lines_finished",
            "Batch requests this server took off a batch, by result (succeeded, errored, "
            "retried: given back unanswered, admission full or the server stopping).",
            ["result"],
        )
        for result in ("succeeded", "errored", "retried"):
            self.batch_lines.labels(model_name, result)
        self.batches_ended = counter(
            "batches_finished",
            "Batches this server ended, by status (completed, cancelled, expired).",
            ["status"],
        )
        for status in ("completed", "cancelled", "expired"):
            self.batches_ended.labels(model_name, status)
        self.admissions = counter(
            "tenant_admissions",
            "Requests each API key (by its name) sent, by admission's result (admitted, refused).",
            ["tenant", "result"],
        )
        self.kv_transfer_seconds = histogram(
            "kv_transfer_seconds",
            "Duration of one KV pull from a prefill server (decode servers).",
            _LATENCY_BUCKETS,
        )
        self.kv_transfer_wait_seconds = histogram(
            "kv_transfer_wait_seconds",
            "Arrival of a decode request to its KV in place: the wait for KV room and the pull.",
            _LATENCY_BUCKETS,
        )
        # Exported from the start on every server, so dashboards and alerts find the series.
        self.kv_transfer_seconds.labels(model_name)
        self.kv_transfer_wait_seconds.labels(model_name)
        #: Each rank's last reported totals (None before its first report).
        self._engine_totals: list[EngineCounters | None] = []
        self.registry.register(_EngineTotals(model_name, self._engine_totals))

    def watch_ranks(
        self, rank_loads: Callable[[], Iterable[RankLoad]], healthy: Callable[[], bool]
    ) -> None:
        """Expose the per-rank gauges and health from these callables."""
        self.registry.register(_RankGauges(self.model_name, rank_loads, healthy))

    def watch_compile_queue(self, counts: Callable[[], CompileQueueCounts | None]) -> None:
        """Expose the grammar compile queue's gauges and refusals from this callable."""
        self.registry.register(_CompileQueueGauges(self.model_name, counts))

    def watch_receive_buffer(self, used: Callable[[], float]) -> None:
        """Expose the bytes held by requests still being received, read from `used`."""
        gauge = Gauge(
            PREFIX + "receive_buffer_bytes",
            "Bytes held by requests still being received (heads and bodies).",
            ["model_name"],
            registry=self.registry,
        )
        gauge.labels(self.model_name).set_function(used)

    def watch_background(self, counts: Callable[[], dict[str, int]]) -> None:
        """Expose this process's background responses by status (queued, in_progress), read
        from `counts`."""
        gauge = Gauge(
            PREFIX + "background_responses",
            "Background responses generating in this server, by status (queued, in_progress).",
            ["model_name", "status"],
            registry=self.registry,
        )
        for status in ("queued", "in_progress"):
            gauge.labels(self.model_name, status).set_function(
                lambda status=status: counts().get(status, 0)  # type: ignore[misc]
            )

    def watch_batches(self, running: Callable[[], int]) -> None:
        """Expose the batch requests this process is answering, read from `running`."""
        gauge = Gauge(
            PREFIX + "batch_lines_running",
            "Batch requests this server is answering (at the lowest priority).",
            ["model_name"],
            registry=self.registry,
        )
        gauge.labels(self.model_name).set_function(running)

    def observe_batch_line(self, result: str) -> None:
        self.batch_lines.labels(self.model_name, result).inc()

    def observe_batch_end(self, status: str) -> None:
        self.batches_ended.labels(self.model_name, status).inc()

    def observe_background_end(self, status: str) -> None:
        self.background_ended.labels(self.model_name, status).inc()

    def watch_tenants(self, tenant_counts: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        """Expose each tenant's running and queued requests from `tenant_counts`."""
        self.registry.register(_TenantGauges(self.model_name, tenant_counts))

    def observe_admission(self, tenant: str, admitted: bool) -> None:
        result = "admitted" if admitted else "refused"
        self.admissions.labels(self.model_name, tenant, result).inc()

    def observe_counters(self, rank: int, counters: EngineCounters) -> None:
        """A rank's disaggregation report: its totals, and its new transfer samples."""
        totals = self._engine_totals
        totals.extend([None] * (rank + 1 - len(totals)))
        totals[rank] = counters
        name = self.model_name
        self.kv_transfer_seconds.labels(name).observe_many(counters.kv_transfer_seconds)
        self.kv_transfer_wait_seconds.labels(name).observe_many(counters.kv_transfer_wait_seconds)

    def observe_step(self, rank: int, seconds: float) -> None:
        self.step_seconds.labels(self.model_name, str(rank)).observe(seconds)

    def observe_failure(self, status: int) -> None:
        self.failure.labels(self.model_name, str(status)).inc()

    def observe_abort(self, reason: AbortReason) -> None:
        self.aborts.labels(self.model_name, reason.value).inc()

    def observe_store_write(self, failed: bool) -> None:
        self.store_writes.labels(self.model_name, "failed" if failed else "stored").inc()

    def observe_engine_request(self, record: RequestRecord) -> None:
        """Token counters and latency histograms of a request that reached the engine."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(record.prompt_tokens)
        self.generation_tokens.labels(name).inc(record.generation_tokens)
        if record.ttft is not None:
            self.ttft.labels(name).observe(record.ttft)
            if record.admitted_at is not None and record.first_token_at is not None:
                started = record.first_token_at - record.first_step_seconds
                self.queue_time.labels(name).observe(max(0.0, started - record.admitted_at))
        self.itl.labels(name).observe_many(record.inter_token_latencies)

    def observe_success(self, record: RequestRecord, now: float) -> None:
        name = self.model_name
        self.success.labels(name, record.finish_reason or "stop").inc()
        self.e2e.labels(name).observe(now - record.arrival)
        self.prompt_tokens_hist.labels(name).observe(record.prompt_tokens)
        self.generation_tokens_hist.labels(name).observe(record.generation_tokens)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return bytes(prometheus_client.generate_latest(self.registry))
