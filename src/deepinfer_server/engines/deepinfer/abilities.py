"""DeepInferAbilities: the typed adapter through which the engine driver reads DeepInfer's engine.

DeepInfer's LLMEngine cannot be changed, so what the driver asks of it beyond its contract is
read here: the scheduler (`get_num_free_gpu_blocks()`) and `cache_config.num_gpu_blocks`, taken
once when the engine is built, and the server's own hooks the engine was built with (its
prefix cache, with the tokens it writes for a retained prompt, or its prefill/decode role as
the connector).
"""

from __future__ import annotations

from typing import Any, Protocol

from deepinfer_server.disaggregation.transfer.connector import KVConnector
from deepinfer_server.engines.abilities import EngineAbilities, KVBlockCounts
from deepinfer_server.ipc.messages import HostTierStats


class _FreeBlocks(Protocol):
    """DeepInfer's Scheduler binding, as far as the driver reads it."""

    def get_num_free_gpu_blocks(self) -> int: ...


class _PrefixCache(Protocol):
    """The prefix cache, as far as the driver reads it (`prefix_cache.PrefixCache`)."""

    def stats(self) -> tuple[int, int, int]: ...

    def written_tokens(self, seq: Any) -> int: ...

    def host_stats(self) -> HostTierStats | None: ...


class DeepInferAbilities(EngineAbilities):
    """What DeepInfer's engine `engine` has beyond `LLMEngine`: `prefix_cache` when it was
    built with the server's prefix cache, `connector` when it plays a prefill/decode role."""

    def __init__(
        self,
        engine: Any,
        connector: KVConnector | None = None,
        prefix_cache: _PrefixCache | None = None,
    ) -> None:
        super().__init__(connector)
        self._prefix_cache = prefix_cache
        self.prefix_caching = prefix_cache is not None
        #: Its `add_request` takes `retention_seconds` (`PrefixCacheHooks`).
        self.retention = self.prefix_caching
        self._scheduler: _FreeBlocks = engine.scheduler
        self._total_blocks = int(engine.cache_config.num_gpu_blocks)

    def prefix_cache_stats(self) -> tuple[int, int, int] | None:
        """The prefix cache's counters, or None without one."""
        return None if self._prefix_cache is None else self._prefix_cache.stats()

    def written_tokens(self, sequence: object) -> int:
        """The prompt tokens the prefix cache reported written for a sequence just added
        (DeepInfer's sequences take no attribute of the server's: the cache holds it)."""
        return 0 if self._prefix_cache is None else self._prefix_cache.written_tokens(sequence)

    def host_tier_stats(self) -> HostTierStats | None:
        """The prefix cache's host tier counters, or None without one."""
        return None if self._prefix_cache is None else self._prefix_cache.host_stats()

    def kv_blocks(self) -> KVBlockCounts:
        """Free blocks from DeepInfer's scheduler, over its pool."""
        return KVBlockCounts(int(self._scheduler.get_num_free_gpu_blocks()), self._total_blocks)
