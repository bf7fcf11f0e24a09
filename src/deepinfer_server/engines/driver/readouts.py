"""Readouts: what a rank reports of its engine besides outputs.

KV usage from the engine's blocks, as DeepInfer's stats logger computes it; the prefix cache's
counters; the prompt tokens the engine computed (its own count when it keeps one, else the
prompt tokens past each request's cached ones, counted here); a decode engine's transfer
statistics and the prompts a prefill engine holds (its `KVConnector`); speculative decoding's
draft counts.
"""

from __future__ import annotations

from deepinfer_server.engines.abilities import EngineAbilities
from deepinfer_server.engines.driver.drafts import DraftCounts
from deepinfer_server.ipc.messages import EngineCounters, PrefixCacheStats


class Readouts:
    """The engine's counters, read through its abilities."""

    def __init__(self, abilities: EngineAbilities) -> None:
        self._abilities = abilities
        self._connector = abilities.connector
        #: Prompt tokens computed, counted here for an engine that does not count them.
        self._counts_computed = abilities.prompt_tokens_computed() is not None
        self._computed = 0
        self._last_stats: PrefixCacheStats | None = None
        self._last_counters = EngineCounters()
        #: Speculative decoding's totals (`EngineCounters.spec_*`).
        self.drafts = DraftCounts()

    def prompt_added(self, prompt_tokens: int, cached: int) -> None:
        """The engine will compute a prompt's tokens past its `cached` ones."""
        if not self._counts_computed:
            self._computed += max(0, prompt_tokens - cached)

    def kv_cache_usage(self) -> float | None:
        """Used KV blocks over allocatable ones, as DeepInfer's stats logger computes it.

        From `scheduler.get_num_free_gpu_blocks()` and `cache_config.num_gpu_blocks`; block 0
        is never allocatable. None for an engine without them.
        """
        blocks = self._abilities.kv_blocks()
        if blocks is None or blocks.total < 2:
            return None
        usable = blocks.total - 1
        return min(1.0, max(0.0, (usable - blocks.free) / usable))

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The engine's prefix-cache counters (one object while unchanged), or None when it
        has no prefix cache."""
        stats = self._abilities.prefix_cache_stats()
        if stats is None:
            return None
        queries, hits, sequences = stats
        now = PrefixCacheStats(
            int(queries), int(hits), int(sequences), self._abilities.host_tier_stats()
        )
        last = self._last_stats
        if last is None or last != now:
            last = self._last_stats = now
        return last

    def counters(self) -> EngineCounters | None:
        """The engine's counters, or None when nothing changed since the last call."""
        counted = self._abilities.prompt_tokens_computed()
        computed = self._computed if counted is None else int(counted)
        stats = self._connector.transfer_stats()
        counters = EngineCounters(computed, held_kv=self._connector.held_count())
        self.drafts.fill(counters)
        if stats is not None:
            counters.kv_transfer_bytes = stats.bytes
            counters.kv_transfer_failures = dict(stats.failures)
            counters.kv_transfer_seconds, stats.seconds = stats.seconds, []
            counters.kv_transfer_wait_seconds, stats.wait_seconds = stats.wait_seconds, []
        if counters == self._last_counters:
            return None
        self._last_counters = EngineCounters(
            counters.prompt_tokens_computed,
            counters.kv_transfer_bytes,
            counters.kv_transfer_failures,
            held_kv=counters.held_kv,
        )
        self.drafts.fill(self._last_counters)
        return counters
