"""The grammar family: the structured-output compile queue of this API server process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from deepinfer_server.metrics.declare import counter_family, gauge_family


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


class CompileQueueGauges(Collector):
    """The grammar compile queue of this API server process, read at scrape time."""

    def __init__(
        self,
        model_name: str,
        counts: Callable[[], CompileQueueCounts | None],
        warm: Callable[[], bool],
    ) -> None:
        self._model_name = model_name
        self._counts = counts
        self._warm = warm

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        labels = [self._model_name]
        waiting = gauge_family(
            "grammar_compiles_waiting", "Structured-output grammars waiting for a compile worker."
        )
        running = gauge_family(
            "grammar_compiles_running", "Structured-output grammars compiling in a compile worker."
        )
        refused = counter_family(
            "grammar_compile_refusals",
            "Grammars refused for want of compile capacity: per_key (429, the API key's "
            "queued compiles at their bound), capacity (503, no worker free in time).",
            "reason",
        )
        workers = gauge_family(
            "grammar_compile_workers_ready",
            "Grammar compile workers started and alive (0 while they are prepared after "
            "start-up: a structured request then waits for them).",
        )
        ready = gauge_family(
            "grammar_ready",
            "1 once structured output is warm: this API process's grammar compile workers all "
            "started and every DP rank's grammar builder warm, so a first structured request "
            "pays no start-up; 0 while they are prepared in the background after start-up.",
        )
        ready.add_metric(labels, 1 if self._warm() else 0)
        workers.add_metric(labels, counts.workers_ready if counts else 0)
        waiting.add_metric(labels, counts.waiting if counts else 0)
        running.add_metric(labels, counts.running if counts else 0)
        refused.add_metric([*labels, "per_key"], counts.refused_per_key if counts else 0)
        refused.add_metric([*labels, "capacity"], counts.refused_busy if counts else 0)
        yield ready
        yield workers
        yield waiting
        yield running
        yield refused
