"""RankSpec: everything a rank process needs, built by the API process (no engine imports)."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_server.engines.backend import EngineSpec


@dataclass(frozen=True)
class RankSpec:
    """The construction parameters of one DP rank process, picklable for spawn."""

    engine: EngineSpec
    #: "module:function" that builds the engine (the backend's `builder`).
    builder: str
    backend_name: str
    #: The socket each API server process (`--api-server-count`) listens on for the ranks, in
    #: the order of the `client` numbers (`coordinator.channels`, `rank.links`).
    api_addresses: tuple[str, ...]
    log_level: str = "info"
    idle_wait_seconds: float = 0.05
    #: How often a loop with nothing to report says it came back (`coordinator.liveness`).
    heartbeat_seconds: float = 1.0

    @property
    def rank(self) -> int:
        return self.engine.rank
