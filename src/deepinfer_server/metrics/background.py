"""The stored, background and batch family: Responses store writes, background responses and
the batch requests a server answers."""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_server.metrics.declare import Declarations


class BackgroundMetrics:
    """Work the server does for stored state rather than for a waiting client."""

    def __init__(self, declare: Declarations) -> None:
        self._declare = declare
        self._name = declare.model_name
        counter = declare.counter
        self.store_writes = counter(
            "response_store_writes",
            "Responses written to the Responses store, by result (stored, failed).",
            ["result"],
            ("stored", "failed"),
        )
        self.background_ended = counter(
            "background_responses_finished",
            "Background responses that ended, by status (completed, incomplete, failed, "
            "cancelled).",
            ["status"],
            ("completed", "incomplete", "failed", "cancelled"),
        )
        self.batch_lines = counter(
            "batch_lines_finished",
            "Batch requests this server took off a batch, by result (succeeded, errored, "
            "retried: given back unanswered, admission full or the server stopping).",
            ["result"],
            ("succeeded", "errored", "retried"),
        )
        self.batches_ended = counter(
            "batches_finished",
            "Batches this server ended, by status (completed, cancelled, expired).",
            ["status"],
            ("completed", "cancelled", "expired"),
        )

    def watch_background(self, counts: Callable[[], dict[str, int]]) -> None:
        """Expose this process's background responses by status (queued, in_progress), read
        from `counts`."""
        gauge = self._declare.gauge(
            "background_responses",
            "Background responses generating in this server, by status (queued, in_progress).",
            ["status"],
        )
        for status in ("queued", "in_progress"):
            gauge.labels(self._name, status).set_function(
                lambda status=status: counts().get(status, 0)  # type: ignore[misc]
            )

    def watch_batches(self, running: Callable[[], int]) -> None:
        """Expose the batch requests this process is answering, read from `running`."""
        gauge = self._declare.gauge(
            "batch_lines_running",
            "Batch requests this server is answering (at the lowest priority).",
        )
        gauge.labels(self._name).set_function(running)

    def observe_store_write(self, failed: bool) -> None:
        """A response written to the store, or a write that failed."""
        self.store_writes.labels(self._name, "failed" if failed else "stored").inc()

    def observe_background_end(self, status: str) -> None:
        """A background response that ended with `status`."""
        self.background_ended.labels(self._name, status).inc()

    def observe_batch_line(self, result: str) -> None:
        """A batch request this server took off a batch, by its result."""
        self.batch_lines.labels(self._name, result).inc()

    def observe_batch_end(self, status: str) -> None:
        """A batch this server ended with `status`."""
        self.batches_ended.labels(self._name, status).inc()
