"""RankReports: what each DP rank's last step report said, and the ranks' loads from it and
from the requests in flight."""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.coordinator.prefix_directory import PrefixDirectory
from deepinfer_server.ipc.messages import PrefixCacheStats, StepOutputs
from deepinfer_server.metrics import RankLoad, ServerMetrics


class RankReports:
    """Each rank's KV-cache usage and prefix-cache counters as of its last step report."""

    def __init__(
        self, size: int, metrics: ServerMetrics, directory: PrefixDirectory | None
    ) -> None:
        self._size = size
        self._metrics = metrics
        self._directory = directory
        self._kv_usage: list[float | None] = [None] * size
        self._prefix_cache: list[PrefixCacheStats | None] = [None] * size

    def step(self, message: StepOutputs) -> None:
        """A rank's step report: its metrics, KV-cache usage and prefix-cache counters."""
        self._metrics.observe_step(message.rank, message.step_seconds)
        self._kv_usage[message.rank] = message.kv_cache_usage
        if message.counters is not None:
            self._metrics.observe_counters(message.rank, message.counters)
        cache = message.prefix_cache
        if cache is not None and cache != self._prefix_cache[message.rank]:
            self._prefix_cache[message.rank] = cache
            if self._directory is not None:
                self._directory.rank_holds(message.rank, cache.sequences)

    def loads(self, handles: Iterable[RequestHandle]) -> list[RankLoad]:
        """Every rank's running and waiting requests and their tokens (from the requests the
        engine owns) and its KV-cache usage (from its last step report)."""
        size = self._size
        running, waiting, tokens = [0] * size, [0] * size, [0] * size
        queued = 0
        for handle in handles:
            if handle.engine_finished:
                continue
            if handle.rank is None:  # in the server's queue: waiting, on no rank yet
                queued += 1
                continue
            if handle.has_first_token:
                running[handle.rank] += 1
            else:
                waiting[handle.rank] += 1
            tokens[handle.rank] += handle.context_tokens
        for rank in range(size):  # spread evenly, so that the sum over ranks is right
            waiting[rank] += queued // size + (rank < queued % size)
        return [
            RankLoad(
                rank,
                running[rank],
                waiting[rank],
                tokens[rank],
                self._kv_usage[rank],
                self._prefix_cache[rank],
            )
            for rank in range(size)
        ]
