"""The requests family: latency and token histograms, outcomes and the receive buffer."""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_server.ipc.messages import AbortReason
from deepinfer_server.metrics.declare import (
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    Declarations,
)
from deepinfer_server.metrics.records import RequestRecord


class RequestMetrics:
    """What the API process observes where its requests end."""

    def __init__(self, declare: Declarations) -> None:
        self._declare = declare
        self._name = declare.model_name
        histogram = declare.histogram
        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to the last token.", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Admission to the start of the engine step that produced the first token.",
            LATENCY_BUCKETS,
        )
        self.prompt_tokens_hist = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS
        )
        self.generation_tokens_hist = histogram(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self._declare_counters(declare)

    def _declare_counters(self, declare: Declarations) -> None:
        counter = declare.counter
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
        self.aborts = counter(
            "request_abort",
            "Engine requests cut short, by reason.",
            ["reason"],
            [reason.value for reason in AbortReason],
        )

    def watch_receive_buffer(self, used: Callable[[], float]) -> None:
        """Expose the bytes held by requests still being received, read from `used`."""
        gauge = self._declare.gauge(
            "receive_buffer_bytes",
            "Bytes held by requests still being received (heads and bodies).",
        )
        gauge.labels(self._name).set_function(used)

    def observe_failure(self, status: int) -> None:
        """A request answered with an error status."""
        self.failure.labels(self._name, str(status)).inc()

    def observe_abort(self, reason: AbortReason) -> None:
        """An engine request cut short."""
        self.aborts.labels(self._name, reason.value).inc()

    def observe_engine_request(self, record: RequestRecord) -> None:
        """Token counters and latency histograms of a request that reached the engine."""
        name = self._name
        self.prompt_tokens.labels(name).inc(record.prompt_tokens)
        self.generation_tokens.labels(name).inc(record.generation_tokens)
        if record.ttft is not None:
            self.ttft.labels(name).observe(record.ttft)
            if record.admitted_at is not None and record.first_token_at is not None:
                started = record.first_token_at - record.first_step_seconds
                self.queue_time.labels(name).observe(max(0.0, started - record.admitted_at))
        self.itl.labels(name).observe_many(record.inter_token_latencies)

    def observe_success(self, record: RequestRecord, now: float) -> None:
        """A request that finished normally at `now`."""
        name = self._name
        self.success.labels(name, record.finish_reason or "stop").inc()
        self.e2e.labels(name).observe(now - record.arrival)
        self.prompt_tokens_hist.labels(name).observe(record.prompt_tokens)
        self.generation_tokens_hist.labels(name).observe(record.generation_tokens)
