"""PrefixCacheSettings: what the prefix cache on DeepInfer's engine reuses, and its host tier's
budget and rates (`prefix_engine.prefix_cache_settings` fills it from the server's options)."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_server.engines.deepinfer.prefix_store import StoreOptions
from deepinfer_server.prefix_cache.retention import KEY_BUDGET_SHARE


@dataclass(frozen=True)
class PrefixCacheSettings:
    """What the cache reuses, and its host tier (`prefix_host`) and shared store."""

    #: Prompts shorter than this are neither cached nor looked up.
    min_tokens: int = 256
    #: How far before its snapshot an entry may be forked (bounded by DeepInfer's rollback room,
    #: DEEPINFER_MAX_BACKTRACKING_TOKENS); 1 serves a thinking-mode user turn.
    max_rollback: int = 1
    #: The share of the slowest tier's blocks (the host tier's, else the pool's) one partition's
    #: retained prompts may pin.
    retention_share: float = KEY_BUDGET_SHARE
    #: The host tier's bytes (`--kv-offload-host-gb`; 0: none, `prefix_host`), the bytes per
    #: second of its copies and the prompt tokens per second a restore must beat.
    host_tier_bytes: int = 0
    host_bandwidth: float = 50e9
    prefill_tokens_per_s: float = 20_000.0
    store: StoreOptions | None = None  # the shared store behind the host tier (`prefix_store`)
