"""PrefixCachingLLMEngine: DeepInfer's LLMEngine with the prefix cache on its hooks."""

from __future__ import annotations

import logging
from typing import Any

from deepinfer_server.disaggregation.layout import checkpoint_identity
from deepinfer_server.engines.backend import EngineSpec
from deepinfer_server.engines.deepinfer.add_request import add_request_args
from deepinfer_server.engines.deepinfer.backend import DeepInferOptions
from deepinfer_server.engines.deepinfer.prefix_cache import PrefixCache
from deepinfer_server.engines.deepinfer.prefix_settings import PrefixCacheSettings
from deepinfer_server.engines.deepinfer.prefix_store import StoreOptions
from deepinfer_server.ipc.messages import HostTierStats

logger = logging.getLogger(__name__)

#: DeepInfer's LLMEngine, which the hooks are mixed before (imported in rank processes only).
_DeepInferEngine: Any = object


class PrefixCacheHooks(_DeepInferEngine):  # type: ignore[misc]
    """The prefix cache on DeepInfer's LLMEngine hooks (`prefix_caching_engine` mixes it in)."""

    prefix_cache_settings = PrefixCacheSettings()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = self.prefix_cache_settings
        self.prefix_cache = PrefixCache(self, settings)
        if self.prefix_cache.disabled is not None:
            logger.warning("[startup] prefix cache off: %s", self.prefix_cache.disabled)
            return
        if self.prefix_cache.host is not None:
            logger.info(
                "[startup] prefix cache host tier on: %.1f GB of host memory",
                settings.host_tier_bytes / 1e9,
            )
        logger.info(
            "[startup] prefix cache on: %d KV blocks, %d state slots (one per running "
            "request, one per snapshot or cached prompt; DEEPINFER_NUM_STATE_SLOTS_RATIO "
            "sets them), prompts of %d tokens or more",
            self.cache_config.num_gpu_blocks - 1,
            self.cache_config.num_state_seqs - 1,
            settings.min_tokens,
        )

    def add_request(
        self,
        *args: Any,
        cache_salt: bytes | None = None,
        retention_seconds: float = 0.0,
        **kwargs: Any,
    ) -> Any:
        """DeepInfer's `add_request`, plus the server's `cache_salt` (the prefix-cache
        partition the request forks from and is kept in) and `retention_seconds` (how long
        its prompt is pinned once kept)."""
        return self.prefix_cache.add_request(
            super().add_request,
            *add_request_args(*args, **kwargs),
            cache_salt=cache_salt,
            retention_seconds=retention_seconds,
        )

    def abort_request(self, request_id: Any) -> tuple[int, int]:
        """DeepInfer's `abort_request`, then the cache's forks and salts it ended."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        return self.prefix_cache.abort_request(super().abort_request, ids)

    def step(self) -> Any:
        """DeepInfer's `step`, after the prompts the host tier holds back are placed and the
        evictions its waiting prompts need."""
        host = self.prefix_cache.host
        if host is not None and host.pending:
            host.place_pending()
        self.prefix_cache.evict_for_demand()
        return super().step()

    def so_builder_has_pending(self) -> bool:
        """DeepInfer's check for requests still outside its queue (its grammar builds), which
        `has_unfinished_requests` counts (across DP ranks): the host tier's too."""
        host = self.prefix_cache.host
        return bool(super().so_builder_has_pending()) or (host is not None and bool(host.pending))

    def post_schedule(self, scheduler_outputs: Any) -> None:
        """DeepInfer's hook after scheduling: note prompts, take snapshots."""
        self.prefix_cache.post_schedule(scheduler_outputs)

    def finalize_seq(self, seq: Any) -> None:
        """DeepInfer's hook on a finished sequence: keep it as an entry, or free it."""
        self.prefix_cache.finalize(seq)

    def host_tier_stats(self) -> HostTierStats | None:
        """The host tier's counters, or None without one."""
        return self.prefix_cache.host_stats()

    def prefix_cache_stats(self) -> tuple[int, int, int]:
        """(prompt tokens looked up, prompt tokens reused, cached sequences now)."""
        return self.prefix_cache.stats()

    def clear_prefix_cache(self) -> None:
        """Evict every cached sequence."""
        self.prefix_cache.clear()


def prefix_cache_settings(spec: EngineSpec) -> PrefixCacheSettings:
    """A rank's cache settings: its partitions' retention share, its host tier's
    (`--kv-offload-host-gb`, per DP rank) budget and rates, and the shared store behind it
    (`--kv-offload-store`)."""
    options = spec.engine_options
    assert isinstance(options, DeepInferOptions)
    master, store = spec.kv_offload_store_master, None
    if spec.kv_offload_store is not None and master is not None:
        checkpoint = checkpoint_identity(spec.model)
        store = StoreOptions(
            master,
            spec.disaggregation_host,
            checkpoint,
            spec.speculative_tokens,
            segment_bytes=int(options.kv_offload_store_segment_gb * 1e9),
            buffer_bytes=int(options.kv_offload_store_buffer_gb * 1e9),
        )
    return PrefixCacheSettings(
        retention_share=spec.prefix_cache_retention_share,
        host_tier_bytes=int(spec.kv_offload_host_gb * 1e9),
        host_bandwidth=options.kv_offload_host_bandwidth_gbps * 1e9,
        prefill_tokens_per_s=options.kv_offload_prefill_tokens_per_s,
        store=store,
    )


def prefix_caching_engine(
    base: type[Any], settings: PrefixCacheSettings | None = None
) -> type[Any]:
    """A subclass of DeepInfer's `LLMEngine` class `base` with the prefix cache."""

    class PrefixCachingLLMEngine(PrefixCacheHooks, base):  # type: ignore[misc]
        """DeepInfer's LLMEngine keeping finished prompts for later requests to fork from."""

        prefix_cache_settings = settings or PrefixCacheSettings()

    return PrefixCachingLLMEngine
