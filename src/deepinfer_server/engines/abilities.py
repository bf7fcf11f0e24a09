"""EngineAbilities: what the engine driver asks an engine beyond DeepInfer's LLMEngine contract.

DeepInfer's own LLMEngine has none of these, so every answer defaults to "nothing": no prefix
cache, no KV read-out, no prompt-token count of its own, and a NORMAL engine's connector
(`disaggregation.transfer.connector.KVConnector`). Each engine builds the abilities it has
(`engines/deepinfer/abilities.py`, `engines/simulated/abilities.py`) and hands them to the
driver beside the engine, so the driver never probes the engine object for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_server.disaggregation.transfer.connector import KVConnector
from deepinfer_server.ipc.messages import HostTierStats


@dataclass(frozen=True)
class KVBlockCounts:
    """The engine's KV blocks now: free ones and the pool's size (block 0 included)."""

    free: int
    total: int


class EngineAbilities:
    """An engine's abilities beyond `LLMEngine`, each answering "nothing" by default."""

    #: Whether the engine has a prefix cache: its `add_request` then takes `cache_salt`.
    prefix_caching: bool = False
    #: Whether its `add_request` takes `retention_seconds` (prompts kept for a time).
    retention: bool = False

    def __init__(self, connector: KVConnector | None = None) -> None:
        #: The rank's prefill/decode role, as the driver reads it.
        self.connector = connector if connector is not None else KVConnector()

    def prefix_cache_stats(self) -> tuple[int, int, int] | None:
        """(prompt tokens looked up, prompt tokens reused, cached sequences now), or None
        without a prefix cache."""
        return None

    def host_tier_stats(self) -> HostTierStats | None:
        """The prefix cache's host-memory tier counters, or None without one."""
        return None

    def prompt_tokens_computed(self) -> int | None:
        """The prompt tokens the engine computed, when it counts them (None: the driver
        counts them)."""
        return self.connector.computed_prompt_tokens()

    def written_tokens(self, sequence: object) -> int:
        """The prompt tokens the engine will write to its prefix cache for the sequence its
        `add_request` just returned (a request with `retention_seconds`; 0: none)."""
        return int(getattr(sequence, "num_written_tokens", 0))

    def kv_blocks(self) -> KVBlockCounts | None:
        """The KV blocks now, or None when the engine cannot tell."""
        return None
