"""The prefix-cache family: each rank's cached sequences and the tokens its cache served.

The counters are tokens, as vLLM's `prefix_cache_queries` and `prefix_cache_hits` count them:
summed over the ranks, each rank's as of its last step report (every API process hears every
rank, so they are never summed over processes). `prefix_cache_hit_tokens{tier}` splits the hits
by where the reused tokens were: `gpu`, the rank's KV pool (a fork), `host`, the host-memory
tier (`--kv-offload-host-gb`: a restore), or `store`, the store shared by the replicas
(`--kv-offload-store`: brought to the host tier, then restored); the host tier's copies (bytes
and seconds each way) and what it holds now are beside them, and the store's errors (each a
miss).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from deepinfer_server.ipc.messages import PrefixCacheStats
from deepinfer_server.metrics.declare import counter_family, gauge_family

#: Every family name, for the metrics every API process sees alike (`aggregate.py`).
PREFIX_CACHE_FAMILIES = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_sequences",
    "prefix_cache_hit_tokens",
    "prefix_cache_host_restore_bytes",
    "prefix_cache_host_restore_seconds",
    "prefix_cache_host_offload_bytes",
    "prefix_cache_host_offload_seconds",
    "prefix_cache_host_sequences",
    "prefix_cache_host_bytes",
    "prefix_cache_host_budget_bytes",
    "prefix_cache_store_errors",
)


class _HostTierFamilies:
    """The host tier's copy counters (summed over the ranks) and occupancy (per rank)."""

    def __init__(self) -> None:
        self.restore_bytes = counter_family(
            "prefix_cache_host_restore_bytes",
            "KV bytes copied from the prefix cache's host tier back to GPUs, over every DP rank.",
        )
        self.restore_seconds = counter_family(
            "prefix_cache_host_restore_seconds",
            "Seconds prompt steps spent copying KV back from the host tier, over every DP rank.",
        )
        self.offload_bytes = counter_family(
            "prefix_cache_host_offload_bytes",
            "KV bytes of evicted prefix-cache entries copied to the host tier, over every DP rank.",
        )
        self.offload_seconds = counter_family(
            "prefix_cache_host_offload_seconds",
            "Seconds of the copies to the host tier (asynchronous: no step waits for them), "
            "over every DP rank.",
        )
        self.sequences = gauge_family(
            "prefix_cache_host_sequences",
            "Sequences held in each DP rank's host tier, at its last engine step.",
            "dp_rank",
        )
        self.bytes = gauge_family(
            "prefix_cache_host_bytes",
            "Bytes held in each DP rank's host tier, at its last engine step.",
            "dp_rank",
        )
        self.budget = gauge_family(
            "prefix_cache_host_budget_bytes",
            "Each DP rank's host-tier budget (--kv-offload-host-gb; 0 without a tier).",
            "dp_rank",
        )
        self._totals = [0.0, 0.0, 0.0, 0.0]

    def add(self, rank_labels: list[str], cache: PrefixCacheStats | None) -> None:
        """One rank's host tier at its last step report."""
        host = None if cache is None else cache.host
        self.sequences.add_metric(rank_labels, host.sequences if host is not None else 0)
        self.bytes.add_metric(rank_labels, host.bytes if host is not None else 0)
        self.budget.add_metric(rank_labels, host.budget_bytes if host is not None else 0)
        if host is not None:
            moved = [host.restore_bytes, host.restore_seconds]
            moved += [host.offload_bytes, host.offload_seconds]
            self._totals = [total + value for total, value in zip(self._totals, moved, strict=True)]

    def families(self, model_name: str) -> Iterator[Metric]:
        """The families, with the ranks' counters summed."""
        counters = [self.restore_bytes, self.restore_seconds]
        counters += [self.offload_bytes, self.offload_seconds]
        for family, total in zip(counters, self._totals, strict=True):
            family.add_metric([model_name], total)
            yield family
        yield self.sequences
        yield self.bytes
        yield self.budget


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
        self.hit_tokens = counter_family(
            "prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache by the tier they were reused from (gpu: "
            "the rank's KV pool; host: the host-memory tier; store: the store the replicas "
            "share), over every DP rank.",
            "tier",
        )
        self.sequences = gauge_family(
            "prefix_cache_sequences",
            "Sequences held in each DP rank's prefix cache, at its last engine step.",
            "dp_rank",
        )
        self.store_errors = counter_family(
            "prefix_cache_store_errors",
            "Errors and unanswered lookups of the shared store (--kv-offload-store), each a "
            "miss, over every DP rank.",
        )
        self.host = _HostTierFamilies()
        self._queries = self._hits = self._host_hits = self._store_hits = self._store_errors = 0

    def add(self, rank_labels: list[str], cache: PrefixCacheStats | None) -> None:
        """One rank's counters at its last step report (None without a cache)."""
        self.sequences.add_metric(rank_labels, cache.sequences if cache is not None else 0)
        self.host.add(rank_labels, cache)
        if cache is not None:
            self._queries += cache.queries
            self._hits += cache.hits
            if cache.host is not None:
                self._host_hits += cache.host.hit_tokens - cache.host.store_hit_tokens
                self._store_hits += cache.host.store_hit_tokens
                self._store_errors += cache.host.store_errors

    def families(self) -> Iterator[Metric]:
        """The families, with the ranks' counters summed."""
        self.queries.add_metric([self._model_name], self._queries)
        self.hits.add_metric([self._model_name], self._hits)
        restored = self._host_hits + self._store_hits
        self.hit_tokens.add_metric([self._model_name, "gpu"], self._hits - restored)
        self.hit_tokens.add_metric([self._model_name, "host"], self._host_hits)
        self.hit_tokens.add_metric([self._model_name, "store"], self._store_hits)
        self.store_errors.add_metric([self._model_name], self._store_errors)
        yield self.queries
        yield self.hits
        yield self.hit_tokens
        yield self.store_errors
        yield self.sequences
        yield from self.host.families(self._model_name)
