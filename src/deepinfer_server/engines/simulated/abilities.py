"""SimulatedAbilities: what the engine driver reads of the simulated engine beyond `LLMEngine`.

The simulated engine mirrors DeepInfer's read-outs (`scheduler.get_num_free_gpu_blocks()`,
`cache_config.num_gpu_blocks`), counts the prompt tokens its prompt steps compute, has the
prefix cache when built with it, and reports its prefill/decode role through its
`pop_kv_handoff`, `kv_transfer_stats`, `held_kv` and `bootstrap_port`, which the connector
here forwards.
"""

from __future__ import annotations

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.layout import KVLayout
from deepinfer_server.disaggregation.transfer.connector import KVConnector
from deepinfer_server.disaggregation.transfer.stats import TransferStats
from deepinfer_server.engines.abilities import EngineAbilities, KVBlockCounts
from deepinfer_server.engines.simulated.engine import LLMEngine
from deepinfer_server.ipc.messages import HostTierStats


class _SimulatedConnector(KVConnector):
    """The simulated engine's role, as the driver reads it."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine

    def pop_handoff(self, request_id: str) -> KVTransferParams | None:
        """A PROMPT engine's handoff of a request that ended."""
        return self._engine.pop_kv_handoff(request_id)

    def transfer_stats(self) -> TransferStats | None:
        """A COMPLETION engine's transfer counters."""
        return self._engine.kv_transfer_stats()

    def held_count(self) -> int:
        """Prompts a PROMPT engine holds for decode servers now."""
        return self._engine.held_kv()

    @property
    def layout(self) -> KVLayout | None:
        """The role's KV layout."""
        return self._engine.kv_layout()

    @property
    def bootstrap_port(self) -> int | None:
        """A PROMPT engine's bound bootstrap port."""
        return self._engine.bootstrap_port()


class SimulatedAbilities(EngineAbilities):
    """The simulated engine `engine`'s abilities; `prefix_caching` as it was built."""

    def __init__(self, engine: LLMEngine, prefix_caching: bool = False) -> None:
        super().__init__(_SimulatedConnector(engine))
        self._engine = engine
        self.prefix_caching = prefix_caching
        self.retention = prefix_caching

    def prefix_cache_stats(self) -> tuple[int, int, int] | None:
        """The prefix cache's counters, or None without one."""
        return self._engine.prefix_cache_stats() if self.prefix_caching else None

    def host_tier_stats(self) -> HostTierStats | None:
        """The prefix cache's host tier's counters, or None without one."""
        return self._engine.host_tier_stats() if self.prefix_caching else None

    def prompt_tokens_computed(self) -> int:
        """The prompt tokens the engine's prompt steps computed."""
        return self._engine.prompt_tokens_computed

    def kv_blocks(self) -> KVBlockCounts:
        """The engine's KV blocks now."""
        engine = self._engine
        return KVBlockCounts(
            engine.scheduler.get_num_free_gpu_blocks(), engine.cache_config.num_gpu_blocks
        )
