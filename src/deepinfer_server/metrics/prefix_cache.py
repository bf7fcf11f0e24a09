"""The prefix-cache family: each rank's cached sequences and the tokens its cache served.

The counters are tokens, as vLLM's `prefix_cache_queries` and `prefix_cache_hits` count them:
summed over the ranks, each rank's as of its last step report (every API process hears every
rank, so they are never summed over processes).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from deepinfer_server.ipc.messages import PrefixCacheStats
from deepinfer_server.metrics.declare import counter_family, gauge_family


class PrefixCacheFamilies:
    """One scrape's prefix-cache families, filled rank by rank."""

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name
        self.queries = counter_family(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache, over every DP rank.",
        )
        self.hits = counter_family(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not computed again), over every DP rank.",
        )
        self.sequences = gauge_family(
            "prefix_cache_sequences",
            "Sequences held in each DP rank's prefix cache, at its last engine step.",
            "dp_rank",
        )
        self._queries = self._hits = 0

    def add(self, rank_labels: list[str], cache: PrefixCacheStats | None) -> None:
        """One rank's counters at its last step report (None without a cache)."""
        self.sequences.add_metric(rank_labels, cache.sequences if cache is not None else 0)
        if cache is not None:
            self._queries += cache.queries
            self._hits += cache.hits

    def families(self) -> Iterator[Metric]:
        """The families, with the ranks' counters summed."""
        self.queries.add_metric([self._model_name], self._queries)
        self.hits.add_metric([self._model_name], self._hits)
        yield self.queries
        yield self.hits
        yield self.sequences
