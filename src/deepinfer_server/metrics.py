"""ServerMetrics: the Prometheus metrics of one server, owned by the API process.

Every series is named `deepinfer:<name>` and labelled with `model_name`, as vLLM names them.
The API process is the only owner, so the numbers stay right with any number of DP ranks:
request metrics are observed where requests end, engine metrics from each rank's step reports,
and the per-rank gauges are read from the coordinator at scrape time.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import prometheus_client
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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

#: Abort reasons: the client left, --request-timeout, the parser ended the answer before the
#: engine did (stop sequence), the service failed under the request, or it shut down.
ABORT_REASONS = ("disconnect", "timeout", "stop", "rank_failure", "shutdown")


@dataclass
class RequestRecord:
    """Timing and token counts of one request, filled in as it runs (`time.perf_counter()`)."""

    arrival: float
    prompt_tokens: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    first_step_seconds: float = 0.0
    last_token_at: float | None = None
    generation_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def on_tokens(self, arrived_at: float, count: int, step_seconds: float) -> None:
        """Record `count` tokens that reached the API process at `arrived_at`."""
        if count <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = arrived_at
            self.first_step_seconds = step_seconds
            # Tokens that came with the first one (speculative decoding) follow it at once.
            self.inter_token_latencies.extend([0.0] * (count - 1))
        else:
            assert self.last_token_at is not None
            # Several tokens in one arrival share the gap since the previous one.
            gap = (arrived_at - self.last_token_at) / count
            self.inter_token_latencies.extend([gap] * count)
        self.generation_tokens += count
        self.last_token_at = arrived_at

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival


class FastHistogram(Collector):
    """A Prometheus histogram without locks, for observations made on the event-loop thread.

    prometheus_client's Histogram takes a lock per observation; at tens of thousands of tokens
    per second that is measurable. All observations here happen on the API process's single
    event-loop thread; scrapes read the plain lists (a scrape during an update can see one
    observation counted in `count` but not yet in a bucket, which Prometheus tolerates).
    """

    def __init__(self, name: str, doc: str, label_names: list[str], buckets: tuple[float, ...]):
        self._name = name
        self._doc = doc
        self._label_names = label_names
        self._bounds = list(buckets)
        self._series: dict[tuple[str, ...], list[float]] = {}

    def labels(self, *values: str) -> _HistogramSeries:
        series = self._series.get(values)
        if series is None:
            # [bucket counts ..., +Inf count, sum]
            series = self._series[values] = [0.0] * (len(self._bounds) + 2)
        return _HistogramSeries(self._bounds, series)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._label_names)
        for values, series in self._series.items():
            cumulative = 0.0
            buckets = []
            for bound, count in zip([*self._bounds, float("inf")], series[:-1], strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))  # type: ignore[no-untyped-call]
            family.add_metric(list(values), buckets, series[-1])
        yield family


class _HistogramSeries:
    """One labelled series of a FastHistogram."""

    __slots__ = ("_bounds", "_series")

    def __init__(self, bounds: list[float], series: list[float]) -> None:
        self._bounds = bounds
        self._series = series

    def observe(self, value: float) -> None:
        self._series[bisect_left(self._bounds, value)] += 1
        self._series[-1] += value

    def observe_many(self, values: Iterable[float]) -> None:
        series = self._series
        bounds = self._bounds
        total = 0.0
        for value in values:
            series[bisect_left(bounds, value)] += 1
            total += value
        series[-1] += total


class _RankGauges(Collector):
    """Per-rank running/waiting counts and health, read from the coordinator at scrape time."""

    def __init__(
        self,
        model_name: str,
        rank_counts: Callable[[], Iterable[tuple[int, int, int]]],
        healthy: Callable[[], bool],
    ) -> None:
        self._model_name = model_name
        self._rank_counts = rank_counts
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
        for rank, running_count, waiting_count in self._rank_counts():
            running.add_metric([self._model_name, str(rank)], running_count)
            waiting.add_metric([self._model_name, str(rank)], waiting_count)
        healthy = GaugeMetricFamily(
            PREFIX + "healthy",
            "1 while every DP rank is alive and stepping, else 0.",
            labels=["model_name"],
        )
        healthy.add_metric([self._model_name], 1.0 if self._healthy() else 0.0)
        yield running
        yield waiting
        yield healthy


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
        for reason in ABORT_REASONS:
            self.aborts.labels(model_name, reason)

    def watch_ranks(
        self,
        rank_counts: Callable[[], Iterable[tuple[int, int, int]]],
        healthy: Callable[[], bool],
    ) -> None:
        """Expose the per-rank gauges and health from these callables."""
        self.registry.register(_RankGauges(self.model_name, rank_counts, healthy))

    def observe_step(self, rank: int, seconds: float) -> None:
        self.step_seconds.labels(self.model_name, str(rank)).observe(seconds)

    def observe_failure(self, status: int) -> None:
        self.failure.labels(self.model_name, str(status)).inc()

    def observe_abort(self, reason: str) -> None:
        self.aborts.labels(self.model_name, reason).inc()

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
